import warnings

try:
    import opacus
except ImportError:  # Colab and fresh environments: Opacus is the one extra package this chapter needs
    import subprocess
    import sys

    # the tested release; it asks for torch>=2.6, so pip leaves an installed torch alone
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "opacus==1.6.0"], check=True)

# Opacus registers full backward hooks; when the inputs do not require grad, PyTorch notes on each
# backward pass that those hooks fire for module outputs only. That is all Opacus needs: dropped by
# that message only.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")
