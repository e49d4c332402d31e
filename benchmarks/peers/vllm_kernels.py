"""mmcache's CPU kernels against vLLM's, shape by shape, in one process; run by the interpreter in
``VLLM_PEER_PYTHON`` (vLLM's own virtual environment, whose torch also has the ATen and oneDNN ops mmcache calls).

usage: $VLLM_PEER_PYTHON benchmarks/peers/vllm_kernels.py [--repeats 7] [--json OUT.json] [--native-lib PATH]

Shapes are the Qwen2.5-0.5B shape's (hidden 896, MLP 4864, 14 query heads and 2 KV heads of 64, vocabulary
151,936, 24 layers) in bf16. Each case times mmcache's kernel and vLLM's on the same inputs, alternating, and
reports the median over ``--repeats`` of each; the ratio is mmcache's median over vLLM's.

* attention: a cold 2048-token causal prefill, and a hit (128 new queries after 1920 cached keys). mmcache:
  ATen's CPU flash attention as ``mmcache.engine.attention`` calls it (one causal call; for the hit, the
  prefix part with query heads stacked per KV head plus the causal part). vLLM: ``cpu_attention_with_kv_cache``
  over its paged cache (block 128), the kernel its CPU attention backend calls.
* decode attention: one query token for each of 4 and of 12 sequences (contexts of 600 to 2,000 tokens), each
  sequence's pages a run for its prompt and its newest page elsewhere, as after its first decoded page. vLLM:
  ``cpu_attention_with_kv_cache`` over its paged cache. mmcache, per sequence as ``mmcache.engine.attention``
  does on ATen's path (one flash call over exactly its own keys: a view where its pages are one run, as before
  its first decoded page, here on a copy of the cache laid out that way; gathered where they are not), and
  padded (every table padded to the longest, gathered into one tensor, one masked call); with
  ``--native-lib``, also the compiled kernel the engine calls (every sequence in one call, pages read through
  the table).
* linears: one product of each shape at 2048, 128, 8 and 1 rows, weights cache-hot. mmcache: a weight packed
  once for oneDNN (``mkldnn._linear_pointwise``, as ``mmcache.engine.compute.kernels``); vLLM: ``onednn_mm``.
* decode step: every linear of a 24-layer decode step at 8 rows plus the LM head, weights streamed from memory
  (about 1 GB). mmcache: seven products a layer (q, k, v, o; gate with SiLU fused, up with the product fused;
  down); vLLM: four (q/k/v fused, o, gate/up fused, down) and the SiLU-and-multiply between them.

This is a measuring instrument, like ``vllm_runner.py``: never imported by the project or its tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

HIDDEN, MLP, HEADS, KV_HEADS, DIM, VOCAB, LAYERS, BLOCK = 896, 4864, 14, 2, 64, 151936, 24, 128
BF16 = torch.bfloat16


def _paired(a, b, repeats: int, inner: int) -> tuple[float, float]:
    """Medians (ms) of ``a`` and ``b``, each timed ``inner`` times per repeat, alternating which goes first."""
    ta, tb = [], []
    a(), b()
    for r in range(repeats):
        for f, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            t = time.perf_counter()
            for _ in range(inner):
                f()
            out.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(ta), statistics.median(tb)


def _vllm_attention(ops, q, key_cache, value_cache, starts, seq_lens, block_table):
    """vLLM's CPU attention over its paged cache, causal, as its backend calls it: ``(run, output)``."""
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_lens=seq_lens,
        dtype=BF16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="amx", enable_kv_split=False)
    result = torch.empty(q.shape[0], HEADS, DIM, dtype=BF16)

    def run():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=result, query_start_loc=starts,
            seq_lens=seq_lens, scale=DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)

    return run, result


def attention_cases(ops, repeats: int) -> list[dict]:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = []
    for name, ctx, q_len, inner in (("attention, cold 2048 causal", 2048, 2048, 3),
                                    ("attention, hit: 128 queries after 1920 cached", 2048, 128, 30)):
        g = torch.Generator().manual_seed(ctx + q_len)
        blocks = -(-ctx // BLOCK)
        cache = torch.zeros(blocks, KV_HEADS, 2 * BLOCK, DIM, dtype=BF16)
        key_cache, value_cache = cache.chunk(2, dim=2)
        k = torch.randn(ctx, KV_HEADS, DIM, generator=g).to(BF16)
        v = torch.randn(ctx, KV_HEADS, DIM, generator=g).to(BF16)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(ctx, dtype=torch.int64), "amx")
        q = torch.randn(q_len, HEADS, DIM, generator=g).to(BF16)
        starts = torch.tensor([0, q_len], dtype=torch.int32)
        lens = torch.tensor([ctx], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        theirs, _ = _vllm_attention(ops, q, key_cache, value_cache, starts, lens, table)

        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        start = ctx - q_len

        def ours():
            if start == 0:
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            stacked = qt.reshape(1, KV_HEADS, -1, DIM)
            return (flash(stacked, kt[:, :, :start], vt[:, :, :start]),
                    flash(qt, kt[:, :, start:], vt[:, :, start:], is_causal=True))

        mine, vllm = _paired(ours, theirs, repeats, inner)
        out.append({"case": name, "mmcache_ms": mine, "vllm_ms": vllm})
    return out


def _compiled_decode(path: str):
    """mmcache's compiled decode kernel (``mmcache/engine/compute/csrc/decode_attention.c``), loaded from the library
    ``mmcache.engine.compute.native.build()`` wrote (this interpreter cannot import mmcache), called as the engine
    calls it: ``run(q, k_pool, v_pool, table, lo, hi, scale) -> out``."""
    import ctypes

    lib = ctypes.CDLL(path)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mmc_decode_attention.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                                         i64, ctypes.c_float, ptr, ctypes.c_int]
    tiles = lib.mmc_init()

    def run(q, k, v, table, lo, hi, scale):
        out = torch.empty_like(q)
        n, kv_heads, group, dim = q.shape
        rc = lib.mmc_decode_attention(1, q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.shape[1],
                                      lo.data_ptr(), hi.data_ptr(), n, kv_heads, group, dim, k.shape[1], k.shape[2],
                                      scale, out.data_ptr(), torch.get_num_threads())
        assert rc == 0, rc
        return out

    return run, bool(tiles)


def decode_attention_cases(ops, repeats: int, compiled=None) -> list[dict]:
    """Decode attention for 4 and for 12 sequences: every way of mmcache's against vLLM's kernel."""
    return [case for n in (4, 12) for case in _decode_attention_case(ops, n, repeats, compiled)]


DECODE_BLOCKS = 512  # the pages of the decode cases' pool


def _decode_attention_case(ops, n: int, repeats: int, compiled) -> list[dict]:
    """One query token for each of ``n`` sequences: each mmcache way checked against vLLM's, then timed."""
    g = torch.Generator().manual_seed(n)
    lens = [600 + (347 * i) % 1400 for i in range(n)]
    tables = _decode_tables(lens)
    width = max(len(t) for t in tables)
    # mmcache's pool (kv_heads, pages, page, d); vLLM's cache written by its own kernel, the same tokens in
    # the same blocks
    pool_k = torch.randn(KV_HEADS, DECODE_BLOCKS, BLOCK, DIM, generator=g).to(BF16)
    pool_v = torch.randn(KV_HEADS, DECODE_BLOCKS, BLOCK, DIM, generator=g).to(BF16)
    key_cache, value_cache = _vllm_cache(ops, pool_k, pool_v, tables, lens)
    q = torch.randn(n, HEADS, DIM, generator=g).to(BF16)
    starts = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    block_table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)
    theirs, result = _vllm_attention(ops, q, key_cache, value_cache, starts, seq_lens, block_table)
    qg = q.reshape(n, KV_HEADS, HEADS // KV_HEADS, DIM)
    ways = _mmcache_decode_ways(qg, pool_k, pool_v, tables, lens, block_table, seq_lens, compiled)
    theirs()
    for _, ours in ways:  # the same attention: layouts and lengths agree
        got = ours().reshape(n, HEADS, DIM).float()
        assert torch.allclose(got, result.float(), atol=2e-2, rtol=0), float((got - result.float()).abs().max())
    out = []
    for how, ours in ways:
        mine, vllm = _paired(ours, theirs, repeats, 50)
        out.append({"case": f"decode attention, {n} sequences, mmcache {how}", "mmcache_ms": mine, "vllm_ms": vllm})
    return out


def _decode_tables(lens: list[int]) -> list[list[int]]:
    """Each sequence's pages: its prompt's pages one run; its newest page taken later, after other sequences'."""
    tables, free = [], iter(range(DECODE_BLOCKS))
    for ctx in lens:
        tables.append([next(free) for _ in range(-(-ctx // BLOCK) - 1)])
    for t in tables:
        t.append(next(free))
    return tables


def _vllm_cache(ops, pool_k, pool_v, tables: list[list[int]], lens: list[int]) -> tuple:
    """vLLM's key and value caches, written by its own kernel: the tokens of mmcache's pool in the same blocks."""
    key_cache, value_cache = torch.zeros(DECODE_BLOCKS, KV_HEADS, 2 * BLOCK, DIM, dtype=BF16).chunk(2, dim=2)
    for t, ctx in zip(tables, lens):
        pos = torch.arange(ctx)
        blocks_of = torch.tensor(t)[pos // BLOCK]
        k = pool_k[:, blocks_of, pos % BLOCK].transpose(0, 1).contiguous()
        v = pool_v[:, blocks_of, pos % BLOCK].transpose(0, 1).contiguous()
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, blocks_of * BLOCK + pos % BLOCK, "amx")
    return key_cache, value_cache


def _mmcache_decode_ways(qg, pool_k, pool_v, tables, lens, block_table, seq_lens, compiled) -> list[tuple]:
    """mmcache's ways of that attention, (how, call): per sequence in runs or apart, padded, compiled."""
    # The same keys and values once more, each sequence's pages one run (as before its first decoded page)
    runs, run_k, run_v, at = [], torch.zeros_like(pool_k), torch.zeros_like(pool_v), 0
    for t in tables:
        runs.append(torch.arange(at, at + len(t)))
        run_k[:, runs[-1]], run_v[:, runs[-1]] = pool_k[:, t], pool_v[:, t]
        at += len(t)
    per_sequence = _per_sequence(qg, lens)
    pages = [torch.tensor(t) for t in tables]
    scattered = lambda: per_sequence(pool_k, pool_v, pages)  # noqa: E731
    in_place = lambda: per_sequence(run_k, run_v, runs)  # noqa: E731
    ways = [("per sequence, pages one run", in_place), ("per sequence, newest page apart", scattered),
            ("padded batch, newest page apart (before ec19f57)", _padded_batch(qg, pool_k, pool_v, block_table,
                                                                               seq_lens))]
    if compiled is not None:
        run, tiles = compiled
        table64, hi = block_table.to(torch.int64), seq_lens.to(torch.int64)
        lo = torch.zeros_like(hi)
        ways.insert(0, (f"compiled kernel{' (AMX scores)' if tiles else ''}, newest page apart",
                        lambda: run(qg, pool_k, pool_v, table64, lo, hi, DIM ** -0.5)))
    return ways


def _per_sequence(qg, lens: list[int]):
    """``attend(pk, pv, tables)``: one flash call per sequence over exactly its own keys."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def attend(pk, pv, tables_):
        o = torch.empty_like(qg)
        for j, ctx in enumerate(lens):
            t = tables_[j]
            first = int(t[0])
            if int(t[-1]) - first == len(t) - 1:  # one run: a view, as PagedBatch.read gives
                ks, vs = pk[:, first:first + len(t)], pv[:, first:first + len(t)]
            else:
                ks, vs = pk.index_select(1, t), pv.index_select(1, t)
            ks, vs = ks.reshape(KV_HEADS, -1, DIM)[:, :ctx], vs.reshape(KV_HEADS, -1, DIM)[:, :ctx]
            o[j] = flash(qg[j:j + 1], ks[None], vs[None], scale=DIM ** -0.5)[0][0]
        return o

    return attend


def _padded_batch(qg, pool_k, pool_v, block_table, seq_lens):
    """mmcache's way before ec19f57: every table padded to the longest, gathered, one masked call."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    n, width = block_table.shape
    flat = block_table.to(torch.int64).reshape(-1)
    kpos = torch.arange(width * BLOCK)[None]
    mask = torch.zeros(n, width * BLOCK, dtype=BF16).masked_fill_(kpos >= seq_lens[:, None], float("-inf"))

    def padded_batch():
        ks = pool_k.index_select(1, flat).view(KV_HEADS, n, -1, DIM).transpose(0, 1)
        vs = pool_v.index_select(1, flat).view(KV_HEADS, n, -1, DIM).transpose(0, 1)
        return sdpa(qg, ks, vs, attn_mask=mask[:, None, None], scale=DIM ** -0.5)

    return padded_batch


def linear_cases(ops, repeats: int) -> list[dict]:
    shapes = [(HIDDEN, HIDDEN + 2 * KV_HEADS * DIM), (HIDDEN, HIDDEN), (HIDDEN, KV_HEADS * DIM),
              (HIDDEN, 2 * MLP), (HIDDEN, MLP), (MLP, HIDDEN)]
    out = []
    for rows in (2048, 128, 8, 1):
        for k_in, n_out in shapes:
            g = torch.Generator().manual_seed(rows * 7 + n_out)
            x = torch.randn(rows, k_in, generator=g).to(BF16)
            w = torch.randn(n_out, k_in, generator=g).to(BF16)
            handle = ops.create_onednn_mm(w.t(), 32)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            mine, vllm = _paired(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                 lambda: ops.onednn_mm(handle, x, None), repeats, 10 if rows == 2048 else 100)
            out.append({"case": f"linear {rows} x {k_in} -> {n_out}", "mmcache_ms": mine, "vllm_ms": vllm})
    return out


def decode_step_case(ops, repeats: int, rows: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(BF16)  # noqa: E731
    mine_layers, vllm_layers = _step_layers(ops, rand)
    head = rand(VOCAB, HIDDEN)
    head_mine, head_vllm = _pack(head), ops.create_onednn_mm(head.t(), 32)
    x0 = rand(rows, HIDDEN)
    mine, vllm = _paired(_mmcache_step(mine_layers, head_mine, x0), _vllm_step(ops, vllm_layers, head_vllm, x0),
                         repeats, 1)
    return {"case": f"decode step linears, {rows} rows, {LAYERS} layers + LM head", "mmcache_ms": mine,
            "vllm_ms": vllm}


def _pack(w):
    """``w`` packed once for oneDNN, as ``mmcache.engine.compute.kernels`` packs a linear's weight."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def _step_layers(ops, rand) -> tuple[list, list]:
    """Each layer's weights drawn by ``rand``, packed mmcache's way (seven products) and vLLM's (four)."""
    mine_layers, vllm_layers = [], []
    for _ in range(LAYERS):
        q, k, v = rand(HIDDEN, HIDDEN), rand(KV_HEADS * DIM, HIDDEN), rand(KV_HEADS * DIM, HIDDEN)
        o = rand(HIDDEN, HIDDEN)
        gate, up, down = rand(MLP, HIDDEN), rand(MLP, HIDDEN), rand(HIDDEN, MLP)
        mine_layers.append([_pack(w) for w in (q, k, v, o, gate, up, down)])
        vllm_layers.append([ops.create_onednn_mm(w.t(), 32)
                            for w in (torch.cat([q, k, v]), o, torch.cat([gate, up]), down)])
    return mine_layers, vllm_layers


def _mmcache_step(layers: list, head, x0):
    """A decode step's linears as mmcache runs them: gate with SiLU fused, up with the product fused."""
    lin = torch.ops.mkldnn._linear_pointwise

    def ours():
        x = x0
        for q, k, v, o, gate, up, down in layers:
            a = lin(x, q, None, "none", [], "")
            lin(x, k, None, "none", [], "")  # k and v are computed, as a layer does, and not used further
            lin(x, v, None, "none", [], "")
            y = lin(a, o, None, "none", [], "")
            h = lin.binary(y, lin(y, gate, None, "swish", [], ""), up, None, "mul")
            x = lin(h, down, None, "none", [], "")
        return lin(x, head, None, "none", [], "")

    return ours


def _vllm_step(ops, layers: list, head, x0):
    """A decode step's linears as vLLM runs them: the SiLU-and-multiply between its fused products."""
    def theirs():
        x = x0
        for qkv, o, gate_up, down in layers:
            a = ops.onednn_mm(qkv, x, None)
            y = ops.onednn_mm(o, a[:, :HIDDEN].contiguous(), None)
            h = ops.onednn_mm(gate_up, y, None)
            x = ops.onednn_mm(down, torch.nn.functional.silu(h[:, :MLP]) * h[:, MLP:], None)
        return ops.onednn_mm(head, x, None)

    return theirs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    p.add_argument("--native-lib", default=None, metavar="PATH",
                   help="mmcache's compiled decode kernel, as printed in mmcache's environment by "
                        "python -c 'from mmcache.engine.compute import native; print(native.build())'")
    a = p.parse_args()
    import vllm
    import vllm._custom_ops as ops

    torch._C._cpu._init_amx()  # vLLM's AMX kernels need the permission this asks the kernel for
    compiled = _compiled_decode(a.native_lib) if a.native_lib else None
    cases = (attention_cases(ops, a.repeats) + decode_attention_cases(ops, a.repeats, compiled)
             + linear_cases(ops, a.repeats) + [decode_step_case(ops, a.repeats)])
    for c in cases:
        c["ratio"] = c["mmcache_ms"] / c["vllm_ms"]
        print(f"{c['case']:<80} mmcache {c['mmcache_ms']:9.3f} ms  vLLM {c['vllm_ms']:9.3f} ms  "
              f"mmcache / vLLM {c['ratio']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "repeats": a.repeats, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
