"""apex.amp's global state, with the private names real code touches
(``amp._amp_state.loss_scalers[0]._loss_scale``)."""


class AmpState:
    def __init__(self):
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1
        self.opt_properties = None
        self.loss_scalers = []
        self.optimizers = []
        self.models = []
        self.device_type = "cpu"


_amp_state = AmpState()


def maybe_print(msg, verbosity=None, rank0=False):
    level = _amp_state.verbosity if verbosity is None else verbosity
    if level > 0:
        print(msg)


def warn_or_err(msg):
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)
