"""The first turn of a VLM chat on vLLM's OpenAI server and on mmcache's, over the same folder: same prompt, same
answer? Prints one JSON verdict.

    source peers/vllm_cpu/env.sh DIR      # VLLM_PEER_PYTHON; torchvision_python_only.py run once in that env
    python -m benchmarks.peers.vlm_first_turn --model FOLDER [--dtypes float32 bfloat16] [--images 4]

FOLDER is a LLaVA or Qwen2-VL folder both servers load (``mmcache export-model bench-llava DIR`` writes one).
For each dtype, vLLM's server (``VllmOpenAIServer``: PIL image processor, the folder's chat template) and then
mmcache's (``mmcache.presets.serving.serve``, in this process) answer the same requests, one at a time: a photo
of ``datasets/images`` as a PNG data URL followed by a LLaVA-Bench question, greedy (temperature 0),
``max_tokens`` tokens, ``return_token_ids``. Per request it records both servers' prompt token counts, answer
ids and text, and vLLM's two most likely first tokens with their logprobs (how decisive the first greedy
choice was; mmcache refuses ``logprobs``). A request is the same when the prompt token counts and the answer
ids are equal.

The servers run one after the other, never together, so neither slows the other on a small machine.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

from .vllm_server import VllmOpenAIServer, block_size_for

DATASETS = Path(__file__).resolve().parents[2] / "datasets"
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "extreme_ironing.jpg")
REQUEST_TIMEOUT_S = 600.0


def photo_url(name: str) -> str:
    """``datasets/images/NAME`` as a PNG data URL (both servers decode the same bytes)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.open(DATASETS / "images" / name).convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def questions(n: int) -> list[str]:
    with open(DATASETS / "vlm" / "qa90_questions.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()][:n]


def post(base_url: str, body: dict) -> dict:
    req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def first_turn(base_url: str, model: str, url: str, question: str, max_tokens: int, logprobs: bool) -> dict:
    """One greedy first turn; its prompt token count, answer ids and text (and vLLM's first-token top 2)."""
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": question}]}]}
    if logprobs:
        body.update(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    out = post(base_url, body)
    choice = out["choices"][0]
    got = {"prompt_tokens": out["usage"]["prompt_tokens"], "token_ids": choice.get("token_ids"),
           "text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}
    content = (choice.get("logprobs") or {}).get("content")
    if content:
        got["first_token_top2"] = [[t["token"], round(t["logprob"], 4)] for t in content[0]["top_logprobs"]]
    return got


def on_vllm(folder: str, dtype: str, asks: list, max_tokens: int, tmp: str) -> tuple[list[dict], dict]:
    log = os.path.join(tmp, f"vllm-{dtype}.log")
    with VllmOpenAIServer(folder, "peer", log, dtype, block_size_for(128), 2048, 4, 2048, vlm=True) as srv:
        answers = [first_turn(srv.base_url, "peer", url, q, max_tokens, True) for _, url, q in asks]
        about = {"version": srv.version(), "ready_s": round(srv.ready_s, 1), "command": " ".join(srv.cmd[1:])}
    return answers, about


def on_mmcache(folder: str, dtype: str, asks: list, max_tokens: int) -> list[dict]:
    from mmcache.presets.serving import serve
    from mmcache.server.config import ServerConfig

    with serve(ServerConfig(model=folder, dtype=dtype)) as srv:
        name = srv.config.chat_model_name
        return [first_turn(srv.base_url, name, url, q, max_tokens, False) for _, url, q in asks]


def compare(folder: str, dtypes: list[str], n_images: int, max_tokens: int) -> dict:
    asks = [(photo, photo_url(photo), q) for photo, q in zip(PHOTOS[:n_images], questions(n_images))]
    runs = []
    with tempfile.TemporaryDirectory(prefix="vlm-first-turn-") as tmp:
        for dtype in dtypes:
            vllm, about = on_vllm(folder, dtype, asks, max_tokens, tmp)
            mine = on_mmcache(folder, dtype, asks, max_tokens)
            rows = []
            for (photo, _, q), theirs, ours in zip(asks, vllm, mine):
                rows.append({"image": photo, "question": q, "vllm": theirs, "mmcache": ours,
                             "same_prompt_tokens": theirs["prompt_tokens"] == ours["prompt_tokens"],
                             "same_answer": theirs["token_ids"] == ours["token_ids"]})
            runs.append({"dtype": dtype, "vllm_server": about, "requests": rows,
                         "all_same": all(r["same_prompt_tokens"] and r["same_answer"] for r in rows)})
    return {"folder": str(folder), "max_tokens": max_tokens, "runs": runs,
            "same_in": [r["dtype"] for r in runs if r["all_same"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a LLaVA or Qwen2-VL folder both servers load")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--images", type=int, default=len(PHOTOS), choices=range(1, len(PHOTOS) + 1),
                   help="how many photos (one first turn each)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error("--max-tokens must be at least 1")
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"{args.model} holds no config.json")
    result = compare(args.model, args.dtypes, args.images, args.max_tokens)
    print(json.dumps(result, indent=1))
    return 0 if len(result["same_in"]) == len(args.dtypes) else 1


if __name__ == "__main__":
    sys.exit(main())
