"""apex's loss scaler: a host-side state machine (``_loss_scale``, ``_unskipped``, ``dynamic``), and
the unscale of gradients into fp32 with an overflow check, on apex-cpp's multi-tensor kernels."""
import torch

from apex._ops import ops


class LossScaler:
    """Dynamic (``loss_scale="dynamic"``: starts at min(2^16, max_loss_scale), halves on overflow,
    doubles after ``scale_window`` clean steps, stays within [min_loss_scale, max_loss_scale]) or
    static (a fixed scale; overflowing steps are still skipped)."""

    warned_no_fused_kernel = False
    warned_unscaling_non_fp32_grad = False
    has_fused_kernel = True

    def __init__(self, loss_scale, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=2000,
                 min_loss_scale=None, max_loss_scale=2.0 ** 24):
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = min(max_loss_scale, init_scale)
        else:
            loss_scale = float(loss_scale)
            if not loss_scale > 0 or loss_scale == float("inf"):
                raise ValueError(f"amp: loss_scale must be 'dynamic' or a finite number > 0, got "
                                 f"{loss_scale}")
            self.dynamic = False
            self._loss_scale = loss_scale
        if min_loss_scale is not None and not 0 < min_loss_scale <= max_loss_scale:
            raise ValueError(f"amp: min_loss_scale must be in (0, max_loss_scale={max_loss_scale}]"
                             f", got {min_loss_scale}")
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._scale_factor = scale_factor
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_buf = torch.zeros(1, dtype=torch.int)
        self._flags = {}

    def loss_scale(self):
        return self._loss_scale

    def clear_overflow_state(self):
        self._has_overflow = False
        self._overflow_buf.zero_()
        for flag in self._flags.values():
            flag.zero_()

    def _flag(self, device):
        """The overflow flag of `device` (one per device, so gradients on several devices all
        count)."""
        if device == self._overflow_buf.device:
            return self._overflow_buf
        if device not in self._flags:
            self._flags[device] = torch.zeros(1, dtype=torch.int, device=device)
        return self._flags[device]

    def unscale(self, model_grads, master_grads, scale):
        """master_grads[i] = model_grads[i] * (1 / scale), converting dtypes; flags overflow."""
        pairs = [(m, g) for m, g in zip(model_grads, master_grads) if m is not None]
        if not pairs:
            return
        by_key = {}
        for m, g in pairs:
            by_key.setdefault((m.device, m.dtype, g.dtype), []).append((m, g))
        for (device, _, _), items in by_key.items():
            ops.multi_tensor_scale(self._flag(device), [m for m, _ in items],
                                   [g for _, g in items], 1.0 / scale)

    def unscale_with_stashed(self, model_grads, stashed_master_grads, master_grads, scale=None):
        """master = model / scale + stashed (gradient accumulation across scale_loss scopes).
        Only the incoming gradients are checked, as apex checks them: an overflow an earlier loss
        left in the stash was that loss's scaler's to report, not this one's."""
        scale = self._loss_scale if scale is None else scale
        triples = [(m, s, o) for m, s, o in zip(model_grads, stashed_master_grads, master_grads)
                   if m is not None]
        by_key = {}
        for m, s, o in triples:
            by_key.setdefault((m.device, m.dtype, s.dtype, o.dtype), []).append((m, s, o))
        for (device, *_), items in by_key.items():
            ops.multi_tensor_axpby(self._flag(device), [m for m, _, _ in items],
                                   [s for _, s, _ in items], [o for _, _, o in items],
                                   1.0 / scale, 1.0, 0)

    def update_scale(self):
        """Reads the overflow flag (one host read) and advances the state machine. Returns whether
        the step must be skipped."""
        self._has_overflow = bool(self._overflow_buf.item() != 0) or any(
            bool(flag.item() != 0) for flag in self._flags.values())
        if self._has_overflow:
            should_skip = True
            if self.dynamic:
                self._loss_scale = self._loss_scale / self._scale_factor
                if self._min_loss_scale is not None:
                    self._loss_scale = max(self._min_loss_scale, self._loss_scale)
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return should_skip
