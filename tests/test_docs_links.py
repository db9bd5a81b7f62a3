"""The README and docs/ link only files that exist in the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_relative_links_point_at_files_in_the_repository():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.exists() or ROOT.resolve() not in resolved.parents:
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
