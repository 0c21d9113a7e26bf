"""SGLang 0.5.23's ``launch_server`` on a CPU, with the workarounds it needs there (issue 27).

    <venv>/bin/python launch/sglang_cpu/launch_server.py --model-path M --device cpu \
        --attention-backend torch_native --disable-cuda-graph --skip-server-warmup \
        --disable-overlap-schedule [--enable-return-routed-experts] ...

Arguments go to ``python -m sglang.launch_server`` unchanged. Before SGLang is imported this sets
``SGLANG_USE_CPU_ENGINE=1`` (SGLang's own switch to its plain-torch CPU paths) and puts ``standin/``
first on ``sys.path`` and ``PYTHONPATH`` (SGLang's spawned processes inherit it), which brings:
- ``standin/sgl_kernel``: the one ``sgl_kernel`` symbol a CPU server calls, in torch (its docstring
  names the upstream lines);
- ``standin/sitecustomize.py``: the start-up fix for ``--enable-return-routed-experts`` with
  ``--device cpu`` (``sglang/srt/mem_cache/pool_host/common.py:147`` calls ``torch.cuda.cudart()``).
Used by the live tier (``tests/live_sglang``) as ``rollout.sglang.launch_command``; on a GPU node use
SGLang's own ``python -m sglang.launch_server`` and its CUDA wheels instead.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "standin"


def install_cpu_workarounds() -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    inherited = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(STANDIN_DIR), *([inherited] if inherited else [])])
    sys.path.insert(0, str(STANDIN_DIR))
    import sitecustomize  # this process started before PYTHONPATH named standin/

    if Path(sitecustomize.__file__).resolve().parent != STANDIN_DIR:
        raise RuntimeError(f"another sitecustomize shadows the CPU workarounds: {sitecustomize.__file__}")


if __name__ == "__main__":
    install_cpu_workarounds()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
