"""A real pip install into a fresh virtual environment: `pip install --no-build-isolation
<checkout>/python` against the installed torch, then `import apex` there."""
import os
import subprocess
import sys
import sysconfig
import textwrap

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)


def test_fresh_venv_install_and_import(tmp_path):
    venv = tmp_path / "venv"
    subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    # The fresh environment sees this environment's torch (and setuptools) through a .pth file,
    # so the install builds against the same LibTorch without downloading anything.
    site = subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip()
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # The venv's own old setuptools would shadow the one torch brought (which builds wheels).
    subprocess.check_call([str(py), "-m", "pip", "uninstall", "-y", "-q", "setuptools"], env=env)
    subprocess.check_call([str(py), "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                           "-q", PYTHON_DIR], env=env)
    check = textwrap.dedent("""
        import apex, amp_C, torch
        from apex.optimizers import FusedAdam
        from apex.normalization import FusedRMSNorm
        from apex.multi_tensor_apply import multi_tensor_applier
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        FusedAdam([p], lr=0.1).step()
        assert p.detach().lt(1).all()
        import os
        libs = sorted(f for f in os.listdir(os.path.dirname(apex.__file__)) if f.endswith(".so"))
        assert {"_apex_cpp.so", "_apex_cpp_stable.so"} <= set(libs), libs
        print(apex.__file__, apex.cpu_isa(), FusedRMSNorm(4)(torch.randn(2, 4)).shape)
    """)
    out = subprocess.check_output([str(py), "-c", check], text=True, cwd=str(tmp_path))
    assert str(venv) in out, out
    assert torch.__version__  # the same torch served both
