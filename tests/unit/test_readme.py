"""The README quickstart stays true: CI runs its command (b) verbatim, and (a) names a
config that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_exactly_two_quickstart_commands():
    cmds = quickstart_commands()
    assert len(cmds) == 2, cmds


def test_ci_runs_readme_command_b_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart_commands()[1] in ci


def test_readme_command_a_names_an_existing_config():
    config = re.search(r"train (\S+\.yaml)", quickstart_commands()[0]).group(1)
    assert (ROOT / config).is_file()
