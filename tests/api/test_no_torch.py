"""The service never imports torch: it installs and runs next to the planner without it."""

import subprocess
import sys


def test_api_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pkgutil, importlib, api\n"
        "for m in pkgutil.walk_packages(api.__path__, 'api.'):\n"
        "    importlib.import_module(m.name)\n"
        "from api.app import create_app; from api.settings import Settings\n"
        "create_app(Settings(db=':memory:')).openapi()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
