"""One mini-engine process: ``python -m cxlkv.mini_engine --weights W --prompt 1,2,3 [--pool P]``.

Prints one JSON line: the generated tokens, the prompt tokens it computed itself, and the
blocks its connector loaded from and saved to the pool. Two such processes on one pool (node
ids differ per host) are a prefill and a decode engine of a P/D pair.
"""
import argparse
import json
import sys

from .. import Error
from .engine import Engine, EngineConfig
from .model import load_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cxlkv.mini_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--weights", required=True, help="HF safetensors (e.g. from `cxlkv generate --save-weights`)")
    ap.add_argument("--model-config", help="the reference engine's JSON config (default: its tiny Llama)")
    ap.add_argument("--prompt", required=True, help="token ids, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pool", help="pool region path(s): use the cxlkv vLLM connector")
    ap.add_argument("--node-id", type=int, default=0)
    ap.add_argument("--layout", default="flash_attn", choices=["flash_attn", "flashinfer", "flashinfer_hnd"])
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args(argv)
    config_json = open(a.model_config).read() if a.model_config else None
    model = load_model(config_json, a.weights)
    prompt = [int(t) for t in a.prompt.split(",") if t]
    connector = extra = None
    if a.pool:
        from ..vllm import CxlKvConnector
        connector, extra = CxlKvConnector, {"pool_path": a.pool, "node_id": a.node_id}
        if a.layout == "flashinfer_hnd":  # as a vLLM deployment with HND caches must configure it
            extra["layout"] = a.layout
    cfg = EngineConfig(num_blocks=a.num_blocks, block_size=a.block_size, layout=a.layout, model_id=model.config.name)
    try:
        engine = Engine(model, cfg, connector=connector, connector_extra=extra)
        try:
            tokens = engine.generate([prompt], a.max_tokens)[0]
            out = {"tokens": tokens, "computed_prompt_tokens": engine.computed_prompt_tokens,
                   "loaded_blocks": engine.worker_conn.loaded_blocks if engine.worker_conn else 0,
                   "saved_blocks": engine.worker_conn.saved_blocks if engine.worker_conn else 0}
        finally:
            engine.close()
    except Error as e:
        print(f"mini_engine: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
