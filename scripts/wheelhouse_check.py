"""Check a wheelhouse (scripts/wheelhouse.py) against its manifest before installing from it:
every listed file present with its sha256, nothing else in wheels/. Standard library only (it
runs before anything is installed). Exit 1 naming the first problem."""

import hashlib
import json
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        sys.exit(f"setup: WHEELHOUSE={root}: no manifest.json (not a wheelhouse made by "
                 "scripts/wheelhouse.py)")
    manifest = json.loads(manifest_path.read_text())
    listed = {entry["path"] for entry in manifest["files"]}
    for entry in manifest["files"]:
        path = root / entry["path"]
        if not path.is_file():
            sys.exit(f"setup: WHEELHOUSE={root}: {entry['path']} is missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
            sys.exit(f"setup: WHEELHOUSE={root}: {entry['path']} does not match its sha256 "
                     "(a truncated copy?)")
    extra = [str(p.relative_to(root)) for p in (root / "wheels").glob("*")
             if str(p.relative_to(root)) not in listed]
    if extra:
        sys.exit(f"setup: WHEELHOUSE={root}: wheels/ holds files its manifest does not list: "
                 f"{', '.join(extra[:3])}")
    print(f"setup: wheelhouse {root}: {len(listed)} files match the manifest "
          f"(Python {manifest['python_version']}, {manifest['total_bytes'] / 2**20:.0f} MiB)")
    if manifest.get("on_target"):
        print(f"setup: the wheelhouse counts on this python for {len(manifest['on_target'])} "
              f"packages (built with --target-has): {', '.join(manifest['on_target'])}")


if __name__ == "__main__":
    main()
