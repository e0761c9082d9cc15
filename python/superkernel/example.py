"""Run notebooks/examples.ipynb headless on the default local pool and print the merged output of each cell.

``python -m superkernel.example [NOTEBOOK] [--ranks N] [--flavor torch|mpi]`` (``bash run.sh example``).
The kernelspec is installed into a temporary prefix, so nothing needs to be installed beforehand.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def find_notebook(name: str) -> Path:
    here = Path(__file__).resolve()
    candidates = [Path(name)]
    if os.environ.get("SUPERKERNEL_EXAMPLES"):
        candidates.append(Path(os.environ["SUPERKERNEL_EXAMPLES"]) / name)
    candidates += [Path.cwd() / "notebooks" / name, here.parent.parent.parent / "notebooks" / name]
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=5)
        if top.returncode == 0:
            candidates.append(Path(top.stdout.strip()) / "notebooks" / name)
    except (OSError, subprocess.TimeoutExpired):
        pass
    for c in candidates:
        if c.is_file():
            return c
    raise SystemExit(f"cannot find {name}; looked in: " + ", ".join(str(c) for c in candidates))


def render_output(out: dict) -> str:
    kind = out.get("output_type")
    if kind == "stream":
        return out["text"]
    if kind in ("execute_result", "display_data"):
        data = out.get("data", {})
        if "text/plain" in data:
            text = data["text/plain"]
        else:
            text = "[" + ", ".join(sorted(data)) + "]"
        prefix = "Out: " if kind == "execute_result" else ""
        return prefix + text + "\n"
    if kind == "error":
        return _ANSI.sub("", "\n".join(out.get("traceback", [])) or f"{out['ename']}: {out['evalue']}") + "\n"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m superkernel.example")
    p.add_argument("notebook", nargs="?", default=None, help="default: notebooks/examples.ipynb (mpi: mpi_examples)")
    p.add_argument("--flavor", choices=["torch", "mpi"], default="torch")
    p.add_argument("--ranks", type=int, default=None, help="default: one per GPU, else 2")
    p.add_argument("--timeout", type=float, default=300, help="per-cell timeout in seconds")
    args = p.parse_args(argv)
    os.environ["SUPERKERNEL_FRONTEND"] = "1"

    import nbformat
    from nbclient import NotebookClient

    from superkernel import install

    name = args.notebook or ("mpi_examples.ipynb" if args.flavor == "mpi" else "examples.ipynb")
    path = find_notebook(name)
    nb = nbformat.read(path, as_version=4)
    prefix = tempfile.mkdtemp(prefix="superkernel-example-")
    try:
        kernel_name = f"superkernel-example-{args.flavor}"
        install.install(args.flavor, kernel_name, args.ranks, prefix=prefix)
        os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter") + os.pathsep + os.environ.get(
            "JUPYTER_PATH", "")
        print(f"# {path} on a local {args.flavor} pool ({args.ranks or 'default number of'} ranks)\n", flush=True)
        t0 = time.monotonic()
        client = NotebookClient(nb, kernel_name=kernel_name, timeout=args.timeout, allow_errors=False,
                                resources={"metadata": {"path": str(path.parent)}})
        failed = None
        try:
            client.execute()
        except Exception as e:  # nbclient's CellExecutionError: the outputs are still in the notebook
            failed = e
        n = 0
        for cell in nb.cells:
            if cell.cell_type != "code":
                continue
            n += 1
            print(f"In [{n}]: " + cell.source.replace("\n", "\n        "))
            for out in cell.get("outputs", []):
                sys.stdout.write(render_output(out))
            print(flush=True)
        print(f"# {n} cells in {time.monotonic() - t0:.1f} s" + (" (FAILED)" if failed else ""))
        return 1 if failed else 0
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
