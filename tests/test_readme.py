"""The README's Python snippets run as written, in order, in one fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

from harness import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_readme_snippets_run_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) >= 5
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks) + "\nprint('snippets ok')\n")
    env = child_env(8, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "snippets ok" in done.stdout
