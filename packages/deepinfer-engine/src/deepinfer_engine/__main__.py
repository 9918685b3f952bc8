import sys

from deepinfer_engine.cli import main

sys.exit(main())
