"""apex's README example, unchanged but for the device: amp.initialize, scale_loss, step, at every
opt level, on this machine's CPU (or CUDA when there is one), with FusedAdam and FusedLayerNorm."""
import time

import torch
import torch.nn.functional as F

import apex
from apex import amp
from apex.normalization import FusedLayerNorm
from apex.optimizers import FusedAdam

device = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 64, generator=g).to(device)
y = (x[:, :8].sum(1) > 0).long()
print(f"apex {apex.__version__} from {apex.__file__}, kernels: {device}"
      f"{'' if device == 'cuda' else ' (' + apex.cpu_isa() + ')'}")
for opt_level in ("O0", "O1", "O2", "O3"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), FusedLayerNorm(256), torch.nn.GELU(),
                                torch.nn.Linear(256, 2)).to(device)
    optimizer = FusedAdam(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    start = time.perf_counter()
    for step in range(100):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"{opt_level}: loss {loss.item():.4f}, accuracy {accuracy:.3f}, "
          f"{time.perf_counter() - start:.2f} s, loss scale "
          f"{amp._amp_state.loss_scalers[0].loss_scale():g}")
