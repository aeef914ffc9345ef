"""Where the package keeps its own files: the Hydra configs and the native kernels' sources.

Both ship inside the package (package data in the wheel), so an installed ddlscale finds them beside
its modules from any working directory. Every lookup goes through these names rather than walking up
from a module's file to a checkout's root, which an installed package does not have.
"""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"  # the config groups: config.yaml, sync/, compressor/, ...
CONF_SEARCH_PATH = "pkg://ddlscale.conf"  # CONF_DIR as Hydra's search path names it (the apps' config_path)
CSRC_DIR = PACKAGE_DIR / "csrc"  # the C++ and CUDA kernels' sources, compiled from where they are installed
