"""Let a venv made from a container's python see that python's packages when the container's
python is itself a venv (`/opt/torch/.venv/bin/python3`, as uv-built images ship it).

`python -m venv --system-site-packages` links the new venv to the BASE interpreter
(sys.base_prefix), so the container venv's torch, Transformer Engine and apex would be
invisible, and the install would look for a torch it must not replace. Run with the
container's python: when it is a venv, a .pth file in the new venv adds its site-packages
(`site.addsitedir`, so their own .pth files apply) after the new venv's own. Standard library
only; prints what it did."""

import site
import sys
from pathlib import Path

PTH = "_container_venv.pth"


def main() -> None:
    venv = Path(sys.argv[1]).resolve()
    if sys.prefix == sys.base_prefix:
        return  # a plain interpreter: --system-site-packages already sees its packages
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    target = venv / "lib" / version / "site-packages"
    if not target.is_dir():
        sys.exit(f"setup: {venv} has no {target.relative_to(venv)} (not a venv of {version}?)")
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages()]
    (target / PTH).write_text("\n".join(lines) + "\n")
    print(f"setup: {sys.executable} is itself a venv ({sys.prefix}): its packages are on "
          f"{venv.name}'s path ({target / PTH})")


if __name__ == "__main__":
    main()
