"""The planner never imports torch: the service and the solver install and run without it."""

import subprocess
import sys


def test_planner_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pkgutil, importlib, planner\n"
        "for m in pkgutil.walk_packages(planner.__path__, 'planner.'):\n"
        "    m.name.endswith('__main__') or importlib.import_module(m.name)\n"
        "from planner.cli import build_parser; build_parser()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
