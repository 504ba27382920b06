"""Write ``sglang_vc_startup.pth`` into the running environment's site-packages, so that
every Python process of the venv gets the start-up shim of ``sglang_vc._startup``
(an editable install has no way to ship a ``.pth`` file of its own)."""

import sysconfig
from pathlib import Path

PTH_NAME = "sglang_vc_startup.pth"


def main() -> None:
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text("import sglang_vc._startup\n")
    print(f"installed {target}")


if __name__ == "__main__":
    main()
