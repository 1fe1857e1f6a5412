"""Where the runtime tests' model files are (imported by name: the runtime tests' conftest puts
this folder on sys.path; `from conftest import ...` would depend on which conftest pytest loaded
last)."""

from pathlib import Path

HERE = Path(__file__).parent
MODELS = HERE / "models"
EXAMPLES = HERE.parent.parent / "examples"
