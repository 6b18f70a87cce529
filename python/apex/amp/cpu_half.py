"""Half-precision matmuls through fp32 on CPUs without fast ones (apex-cpp's C++
``apex::amp::CpuHalfFallbackGuard``, docs/amp.md).

On a CPU without AVX512-BF16, AMX or AVX512-FP16 (every AVX2-only x86 CPU), torch multiplies
bf16 and fp16 matrices in a scalar loop: ``torch.autocast("cpu")`` trains tens of times slower than
fp32 there (on AVX-512 without AVX512-BF16, Intel's servers from Skylake to Ice Lake, bf16 runs
through oneDNN's emulation, below fp32's speed). In a ``cpu_half_fallback()`` scope, bf16/fp16
``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addbmm`` (so ``linear``, ``matmul`` and ``conv_tbc``;
in place and ``out=`` too), ``nn.LSTM``/``nn.GRU``, convolutions and the CPU flash attention
compute in fp32 (apex-cpp's own product and attention kernels, or torch's fp32 kernels on
exactly widened inputs), their outputs rounded once to the half dtype, and GELU
and SiLU (forward and backward) read a correctly rounded table per half dtype. The scope
belongs to the thread that opens it; where torch's half path is fast it does nothing (per
dtype: a CPU with AVX512-BF16 but no AVX512-FP16 takes the fallback for fp16 alone), and
``APEX_CPU_HALF_FALLBACK=0`` turns it off (``=1`` on, to compare). ``apex.amp`` opens it around the
forward of the models it patched and around the backward inside ``scale_loss`` at O1-O3; code
that casts its model itself opens it by hand::

    model.to(torch.bfloat16)
    with apex.amp.cpu_half_fallback():
        loss = loss_fn(model(x), y)
        loss.backward()
"""
import threading

import torch

from apex._ops import ops

_is_compiling = torch.compiler.is_compiling


class cpu_half_fallback:  # noqa: N801 (a context manager, named like torch's)
    """A scope in which this thread's half matmuls and convolutions on the CPU take the fp32
    route (a no-op where it is not available, and inside ``torch.compile``, whose graphs do not
    see it)."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self._local = threading.local()  # what each entry took, per thread (one object may be
        # shared between threads, each with scopes of its own)

    def __enter__(self):
        held = self._local.__dict__.setdefault("held", [])
        held.append(bool(self.enabled) and not _is_compiling() and ops.cpu_half_fallback_enter())
        return self

    def __exit__(self, *exc):
        if self._local.held.pop():
            ops.cpu_half_fallback_exit()
        return False


def cpu_half_fallback_available(dtype=None):
    """Whether the CPU half fallback is used on this CPU for ``dtype`` (``torch.bfloat16`` or
    ``torch.float16``; None: for either), decided once per process from cpuid and
    ``APEX_CPU_HALF_FALLBACK`` (and oneDNN's ``ONEDNN_MAX_CPU_ISA``): a CPU with AVX512-BF16
    but no AVX512-FP16 takes it for fp16 only."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"cpu_half_fallback_available: expected torch.bfloat16 or torch.float16, "
                         f"got {dtype}")
    return ops.cpu_half_fallback_available(dtype)


def prepare_cpu_half_fallback():
    """Puts the fallback's kernels into torch's dispatcher now (where it is available) instead
    of on the first scope: the dispatcher is not safe to change while other threads run the ops
    concerned, so ``apex.amp.initialize`` calls this at setup."""
    ops.cpu_half_fallback_prepare()


def cpu_half_fallback_active():
    """Whether a scope is open in this thread and the fallback is in use."""
    return ops.cpu_half_fallback_active()
