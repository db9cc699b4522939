"""Entry point: ``python3 -I -S <dir>/agent --socket-dir ... --work-dir ...``.

Run as a directory, Python puts the directory itself on ``sys.path``; the package's
relative imports need its parent there instead, and the package imported by name.
"""

import importlib
import os
import sys

if not __package__:
    sys.path[0] = os.path.dirname(sys.path[0])
    __package__ = os.path.basename(os.path.dirname(os.path.abspath(__file__)))
    importlib.import_module(__package__)

from .control import main

sys.exit(main())
