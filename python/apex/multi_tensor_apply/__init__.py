"""apex's multi-tensor applier: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls
``op(chunk_size, noop_flag, tensor_lists, *args)``, as apex's does; the ops are ``amp_C``'s."""
from .multi_tensor_apply import MultiTensorApply

multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
