"""Cross-checks apex-cpp state files against the Python torch package.

Run by CTest (label `python`): python test_interop.py /path/to/apex_interop
"""
import os
import subprocess
import sys
import tempfile

import torch

TOOL = sys.argv[1]


def run(*args):
    return subprocess.run([TOOL, *args], check=True, capture_output=True, text=True).stdout


def python_gradscaler_run():
    """The same script interop.cpp runs, with torch.amp.GradScaler."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.tensor([0.5, -1.0, 0.25])
    for step in range(7):
        opt.zero_grad()
        scaler.scale((w * x).sum()).backward()
        if step in (1, 4):
            w.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return scaler, w.detach()


def check_gradscaler_cpp_to_python(tmp):
    path = os.path.join(tmp, "cpp_scaler.pt")
    out = run("gradscaler-run", path)
    cpp_w = torch.tensor([float(v) for v in out.split()[1:]])
    py_scaler, py_w = python_gradscaler_run()
    loaded = torch.load(path, weights_only=True)
    expected = py_scaler.state_dict()
    assert set(loaded) == set(expected), (loaded, expected)
    for key, value in expected.items():
        assert type(loaded[key]) is type(value), (key, type(loaded[key]), type(value))
        assert loaded[key] == value, (key, loaded[key], value)
    assert torch.equal(cpp_w, py_w), (cpp_w, py_w)
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(loaded)
    assert fresh.get_scale() == expected["scale"]
    print("gradscaler C++ -> Python: ok", loaded)


def check_gradscaler_python_to_cpp(tmp):
    path = os.path.join(tmp, "py_scaler.pt")
    scaler = torch.amp.GradScaler("cpu", init_scale=384.0, growth_factor=3.0,
                                  backoff_factor=0.25, growth_interval=5)
    scaler.scale(torch.tensor(1.0))
    scaler._growth_tracker.fill_(3)
    torch.save(scaler.state_dict(), path)
    fields = run("gradscaler-read", path).split()
    got = dict(zip(fields[0::2], fields[1::2]))
    assert float(got["scale"]) == 384.0, got
    assert float(got["growth_factor"]) == 3.0, got
    assert float(got["backoff_factor"]) == 0.25, got
    assert int(got["growth_interval"]) == 5, got
    assert int(got["growth_tracker"]) == 3, got
    print("gradscaler Python -> C++: ok", got)


def check_amp_state(tmp):
    amp_path = os.path.join(tmp, "amp.pt")
    params_path = os.path.join(tmp, "params.pt")
    run("amp-write", amp_path, params_path)
    state = torch.load(amp_path, weights_only=True)
    params = torch.load(params_path, weights_only=True)
    assert state["opt_level"] == "O2", state
    assert state["loss_scaler0"]["loss_scale"] == 1.0, state  # bf16: static 1.0
    masters = state["master_params"][0]
    assert len(masters) == len(params) == 2
    for master, param in zip(masters, params):
        assert master.dtype == torch.float32 and param.dtype == torch.bfloat16
        assert torch.equal(master.to(torch.bfloat16), param)
    print("amp state readable with weights_only=True: ok")


def check_resume_in_fresh_process(tmp):
    """Train 10 steps in one process; train 6, save, and resume for 4 in a new process."""
    full = os.path.join(tmp, "full.pt")
    part = os.path.join(tmp, "part.pt")
    resumed = os.path.join(tmp, "resumed.pt")
    run("amp-train", tmp, "0", "10", full)
    run("amp-train", tmp, "0", "6", part, "save")
    run("amp-train", tmp, "6", "10", resumed, "resume")
    a = torch.load(full, weights_only=True)
    b = torch.load(resumed, weights_only=True)
    assert len(a["tensors"]) == len(b["tensors"]) > 0
    for i, (x, y) in enumerate(zip(a["tensors"], b["tensors"])):
        assert x.dtype == y.dtype and torch.equal(x, y), f"tensor {i} differs after resume"
    assert a["loss_scale"] == b["loss_scale"], (a["loss_scale"], b["loss_scale"])
    assert torch.load(part, weights_only=True)["skipped"] == 1  # the injected overflow
    print("O2 resume in a fresh process is bit-identical: ok", a["loss_scale"])


def main():
    with tempfile.TemporaryDirectory() as tmp:
        check_gradscaler_cpp_to_python(tmp)
        check_gradscaler_python_to_cpp(tmp)
        check_amp_state(tmp)
        check_resume_in_fresh_process(tmp)
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
