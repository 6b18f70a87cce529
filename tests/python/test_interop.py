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


OPTIMIZERS = {
    "adam": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                                             initial_accumulator_value=0.1),
}


def python_steps(kind, params, grads, state=None):
    params = [p.clone().requires_grad_(True) for p in params]
    opt = OPTIMIZERS[kind](params)
    if state is not None:
        opt.load_state_dict(state)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt.state_dict()


def assert_close_lists(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}[{i}]: {m}")


def check_optimizer_state(tmp, kind):
    """FusedAdam/SGD/Adagrad vs torch.optim over 3 steps, then the state crosses over in both
    directions and 2 more steps must match an uninterrupted Python run."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(7,), (33, 5), (1,), (4, 3, 2)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    reference, _ = python_steps(kind, params, grads)
    py_a, py_state = python_steps(kind, params, grads[:3])

    def cpp(payload):
        src, dst = os.path.join(tmp, f"{kind}_in.pt"), os.path.join(tmp, f"{kind}_out.pt")
        torch.save(payload, src)
        run("optim-run", kind, src, dst)
        return torch.load(dst, weights_only=True)

    a = cpp({"params": params, "grads": grads[:3]})
    assert_close_lists(a["params"], py_a, f"{kind} params after 3 steps")
    for idx, entry in py_state["state"].items():
        for key, value in entry.items():
            got = a["state"]["state"][idx][key]
            torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float32),
                                       torch.as_tensor(value, dtype=torch.float32),
                                       rtol=1e-5, atol=1e-6)
    # C++ state -> Python optimizer.
    py_b, _ = python_steps(kind, a["params"], grads[3:], state=a["state"])
    assert_close_lists(py_b, reference, f"{kind}: C++ state continued in Python")
    # Python state -> C++ optimizer.
    b = cpp({"params": py_a, "grads": grads[3:], "state": py_state})
    assert_close_lists(b["params"], reference, f"{kind}: Python state continued in C++")
    print(f"{kind}: torch.optim state round trip both ways: ok")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        check_gradscaler_cpp_to_python(tmp)
        check_gradscaler_python_to_cpp(tmp)
        check_amp_state(tmp)
        check_resume_in_fresh_process(tmp)
        for kind in OPTIMIZERS:
            check_optimizer_state(tmp, kind)
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
