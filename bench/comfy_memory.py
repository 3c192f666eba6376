"""What *Unload Models* and *Free model and node cache* do to the pack's models in a real ComfyUI (CPU host).

    .venv/bin/python bench/comfy_memory.py --host /path/ComfyUI=/path/venv/bin/python [--layers 8]

Runs the tiny CPU workflow with a larger random target DiT (dim 1536, FFN 8960 like the 1.3B, ``--layers`` blocks,
fp32) so the memory moves are visible, then prints the server's RSS and ``GET /sdvg/models`` after: the run, POST
/free {"unload_models": true}, a second run, POST /free {"unload_models": true, "free_memory": true}, a third run.
On a CPU host "evicted" weights stay in RAM (the offload device is the CPU); free_memory is what returns RAM.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

logger = logging.getLogger("comfy_memory")


def _models_dir(layers: int) -> Path:
    from safetensors.torch import save_file

    from sdvg.fixtures.tiny import TINY_TEXT_DIM, make_tiny, random_original_state_dict
    from sdvg.loaders.wan_keys import make_config

    root = Path(tempfile.mkdtemp(prefix="sdvg-mem-"))
    make_tiny(root)
    cfg = make_config(12, 128, 16, 16, TINY_TEXT_DIM, 256, 8960, layers, (1, 2, 2))
    save_file(random_original_state_dict(cfg, seed=5), str(root / "diffusion_models" / "sdvg_medium_target.safetensors"))
    return root


def _state(server) -> dict:
    s = server.get("/sdvg/models")
    return {"rss_mib": round(s["rss_bytes"] / 2**20), "models": len(s["models"]),
            "comfy_loaded": sum(m["comfy_loaded"] for m in s["models"]),
            "weights_mib": round(sum(m["bytes"] for m in s["models"]) / 2**20)}


def _free(server, body: dict, predicate, timeout: float = 60.0) -> dict:
    deadline = time.time() + timeout
    while True:  # re-posted: ComfyUI's worker can miss the wake-up of a flag set while it is busy
        server.post("/free", body)
        time.sleep(2.0)
        state = server.get("/sdvg/models")
        if predicate(state) or time.time() > deadline:
            return _state(server)


def main() -> None:
    from tests.host import comfy_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", required=True, help="TREE=PYTHON of a ComfyUI host")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    tree, python = args.host.split("=", 1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = _models_dir(args.layers)
    server = comfy_server.ComfyServer(root, host=(Path(tree), python)).start()
    try:
        prompt = json.loads((REPO / "tests" / "workflows" / "sdvg_tiny_cpu.api.json").read_text(encoding="utf-8"))
        target = prompt["8"]["inputs"]["target"][0]
        prompt[target]["inputs"]["model_name"] = "sdvg_medium_target.safetensors"
        rows = [("idle server", _state(server))]

        def run(seed: int, label: str) -> None:
            prompt["8"]["inputs"].update(seed=seed, blocks=2)
            assert "execution_success" in server.run(prompt).types(), server.server_log()[-2000:]
            rows.append((label, _state(server)))

        run(1, "after a run")
        rows.append(("after Unload Models", _free(server, {"unload_models": True},
                                                  lambda s: not any(m["comfy_loaded"] for m in s["models"]))))
        run(2, "after a second run")
        rows.append(("after Free model and node cache",
                     _free(server, {"unload_models": True, "free_memory": True}, lambda s: not s["models"])))
        run(3, "after a third run")
        logger.info("%s (%s)", comfy_server.comfy_version(Path(tree)), tree)
        for label, s in rows:
            logger.info("%-34s RSS %6d MiB  models %d  ComfyUI-loaded %d  weights %5d MiB", label, s["rss_mib"],
                        s["models"], s["comfy_loaded"], s["weights_mib"])
    finally:
        server.stop()


if __name__ == "__main__":
    main()
