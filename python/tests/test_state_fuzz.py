"""The Python package's state files, damaged as a careless or hostile user would damage them (the
C++ suite's tests/reliability/test_state_files.cpp, for `torch.save`d state dicts): cut at many
lengths, every byte of the pickle flipped, bytes of the zip headers and the tensor payload
flipped, zeroed, replaced by text, and swapped for another kind's file. Every case must end in an
exception with the optimizer or amp state bit-identical to before, or in a state that passes
every check the loader makes (hyperparameters finite and in range, state shaped like its
parameters). torch's format carries no checksum of the tensor payload, so a flipped payload byte
loads as another number: that limit is torch's (docs/reliability.md), the pickle's values are
ours to check."""
import copy
import io
import math
import zipfile

import pytest
import torch

import apex
from apex import amp
from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _trained(make):
    model = _model()
    opt = make(model.parameters())
    for i in range(2):
        torch.manual_seed(i)
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    return model, opt


KINDS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
}


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _snapshot(opt):
    sd = opt.state_dict()
    return {"groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                     for g in sd["param_groups"]]),
            "state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                      for i, s in sd["state"].items()}}


def _same(a, b):
    if a["groups"] != b["groups"] or a["state"].keys() != b["state"].keys():
        return False
    for i in a["state"]:
        x, y = a["state"][i], b["state"][i]
        if x.keys() != y.keys():
            return False
        for k in x:
            if torch.is_tensor(x[k]) != torch.is_tensor(y[k]):
                return False
            if torch.is_tensor(x[k]):
                if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or \
                        not torch.equal(x[k].view(-1).view(torch.uint8),
                                        y[k].view(-1).view(torch.uint8)):
                    return False
            elif x[k] != y[k]:
                return False
    return True


def _valid(snap, intact):
    """A loaded state that passes the loader: the intact file's layout, numbers in range."""
    if snap["state"].keys() != intact["state"].keys() or len(snap["groups"]) != len(intact["groups"]):
        return False
    for g in snap["groups"]:
        for key, value in g.items():
            if key == "betas":
                if not all(0 <= b < 1 for b in value):
                    return False
            elif isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                return False
    for i, s in snap["state"].items():
        for k, v in s.items():
            w = intact["state"][i][k]
            if torch.is_tensor(w) and (not torch.is_tensor(v) or v.shape != w.shape):
                return False
    return True


def _damaged(data):
    """(what, bytes) cases: cuts, flips of every pickle byte and of spread bytes, zero, text."""
    cases = [(f"cut at {n}", data[:n]) for n in sorted({0, 1, 4, 22, 30, 64, 100, len(data) // 3,
                                                         len(data) // 2, len(data) - 22,
                                                         len(data) - 1})]
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        # The record's bytes start after its local header (30 bytes + name + extra).
        name_len = int.from_bytes(data[pkl.header_offset + 26:pkl.header_offset + 28], "little")
        extra_len = int.from_bytes(data[pkl.header_offset + 28:pkl.header_offset + 30], "little")
        start = pkl.header_offset + 30 + name_len + extra_len
        span = range(start, start + pkl.compress_size)
    positions = list(span) + list(range(0, len(data), max(1, len(data) // 150)))
    for pos in positions:
        for mask in (0xFF, 0x01):
            b = bytearray(data)
            b[pos] ^= mask
            cases.append((f"byte {pos} ^ {mask:#x}", bytes(b)))
    cases.append(("zeroed", bytes(len(data))))
    cases.append(("text", b"not a checkpoint\n" * 8))
    return cases


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_damaged_optimizer_state_is_an_error_or_valid(kind):
    _, source = _trained(KINDS[kind])
    data = _saved(source.state_dict())
    intact = _snapshot(source)
    others = [_saved(_trained(KINDS[k])[1].state_dict()) for k in sorted(KINDS) if k != kind]
    cases = _damaged(data) + [(f"another optimizer's file ({i})", o) for i, o in enumerate(others)]
    outcomes = {"error": 0, "valid": 0}
    for what, bad in cases:
        _, target = _trained(lambda ps: KINDS[kind](ps))
        before = _snapshot(target)
        try:
            loaded = torch.load(io.BytesIO(bad), weights_only=True)
            target.load_state_dict(loaded)
        except Exception:  # any clear error: what matters is that nothing changed
            assert _same(_snapshot(target), before), f"{kind}, {what}: a refused load changed state"
            outcomes["error"] += 1
            continue
        # Loaded: then exactly the intact file's state (the checksum covers keys, tensors and
        # step), with hyperparameters that may differ only within their valid ranges (they stay
        # out of the checksum, so that a new lr can be set in a saved state).
        snap = _snapshot(target)
        assert _valid(snap, intact), f"{kind}, {what}: loaded a state the loader must refuse"
        hyper = [{k: v for k, v in g.items() if k not in ("lr", "eps", "weight_decay", "betas",
                                                          "momentum", "dampening",
                                                          "max_grad_norm")}
                 for g in snap["groups"]]
        assert _same({"groups": hyper, "state": snap["state"]},
                     {"groups": [{k: v for k, v in g.items() if k in h} for g, h in
                                 zip(intact["groups"], hyper)], "state": intact["state"]}), \
            f"{kind}, {what}: loaded another state"
        outcomes["valid"] += 1
    assert outcomes["error"] > 0 and outcomes["valid"] > 0, outcomes


def test_every_damaged_amp_state_is_an_error_or_valid():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                loss_scale="dynamic", verbosity=0)
    for i in range(2):
        torch.manual_seed(i)
        with amp.scale_loss(model(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().mean(),
                            opt) as loss:
            loss.backward()
        opt.step()
    data = _saved(amp.state_dict())
    scaler = amp._amp_state.loss_scalers[0]

    def snap():
        return (scaler.loss_scale(), scaler._unskipped,
                [m.detach().clone() for m in opt._amp_stash.all_fp32_from_fp16_params],
                [p.detach().clone() for p in model.parameters()])

    for what, bad in _damaged(data):
        before = snap()
        try:
            amp.load_state_dict(torch.load(io.BytesIO(bad), weights_only=True))
        except Exception:
            after = snap()
            assert after[:2] == before[:2], f"amp, {what}: a refused load changed the loss scaler"
            assert all(torch.equal(a, b) for a, b in zip(after[2] + after[3], before[2] + before[3])), \
                f"amp, {what}: a refused load changed masters or weights"
            continue
        scale, unskipped = scaler.loss_scale(), scaler._unskipped
        assert math.isfinite(scale) and scale > 0 and unskipped >= 0, (what, scale, unskipped)
        # Put the intact state back for the next case.
        amp.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))
