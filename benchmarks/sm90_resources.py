"""Registers, spills and shared memory of the MoE, KDA and DSA decode kernels compiled for SM90 (Hopper) on a
machine without a GPU: Triton compiles to a cubin with the ptxas it ships, and its cuobjdump reads the
resource usage. A prediction before device time is spent (a kernel that spills at a plan is slow there),
and a check that a change compiles for the GPU at all (the interpreter runs code the compiler refuses).

    python benchmarks/sm90_resources.py [--only moe|kda|dsa] [--ptx-hash] [--no-specialise]

Each kernel is compiled as a launch at the real shapes specialises it (every pointer and the integers of
`DIV16` divisible by 16): without that, registers and spills come out far from what the GPU runs (the KDA
decode kernel: 920 bytes of spills against none, s46). --ptx-hash prints a hash of each kernel's PTX without its debug lines: equal hashes before and after a
refactor mean the GPU runs the same instructions.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from glm5next.kernels.dsa import attention as dsa_attention, indexer as dsa_indexer
from glm5next.kernels.kda import kernel as kda
from glm5next.kernels.moe import experts, prefill

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
FLOATS = {"limit", "lower_bound", "eps", "scale", "l2_eps"}
DIV16 = {"N", "K", "H", "stride_x", "sq", "sk", "sv", "sf", "sg", "sb", "s_win", "s_vq", "shared_wg", "shared_wu",
         "shared_sg", "shared_su", "shared_w", "shared_s", "R", "s_sel", "s_tab", "s_src", "s_dst", "n_pools", "s_xt", "s_xh"}
"""Integer arguments that are multiples of 16 at the real shapes: a launch specialises them (and every pointer,
16-byte aligned) as divisible by 16, which changes vector widths and so registers; the compile here does too."""


def signature(fn, pointers: dict[str, str], consts: dict) -> dict[str, str]:
    """Every argument's type: pointers as given (else int32 pointers), constexprs, fp32 scalars, int32."""
    return {a: "constexpr" if a in consts else pointers.get(a, "*i32" if a.endswith("_ptr") else
                                                              "fp32" if a in FLOATS else "i32")
            for a in fn.arg_names}


def attributes(fn, pointers: dict[str, str], consts: dict) -> dict:
    """The divisibility a real launch gives: every pointer argument and the integers of `DIV16`."""
    div = triton.compiler.make_backend(TARGET).parse_attr("D")
    sig = signature(fn, pointers, consts)
    return {(i,): div for i, a in enumerate(fn.arg_names)
            if a not in consts and (sig[a].startswith("*") or (a in DIV16 and sig[a] == "i32"))}


def cases() -> list[tuple[str, str, object, dict, dict, int, int]]:
    """(group, name, kernel, pointer types, constexprs, warps, pipeline stages) at the production plans."""
    out = []
    for fp8 in (True, False):
        w = "*fp8e4nv" if fp8 else "*bf16"
        half = dict(HAS_SCALE=fp8, F32=False, HALF=fp8)
        up = {"x_ptr": "*bf16", "wg_ptr": w, "wu_ptr": w, "sg_ptr": "*fp32", "su_ptr": "*fp32", "h_ptr": "*fp16"}
        down = {"h_ptr": "*fp16", "w_ptr": w, "s_ptr": "*fp32", "weights_ptr": "*fp32", "y_ptr": "*fp32"}
        tag = "fp8" if fp8 else "bf16"
        for n, stages, at in ((128, 3, "1 token"), (32, 4, "2 tokens"), (64, 4, "4-64 tokens")):
            out.append(("moe", f"gate_up {tag} BLOCK_N {n} ({at})", experts.gate_up_kernel, up,
                        dict(TOP_K=8, BLOCK_M=16, BLOCK_N=n, BLOCK_K=128, **half), 4, stages))
        out.append(("moe", f"down {tag} BLOCK_N 64", experts.down_kernel, down,
                    dict(TOP_K=8, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, **half), 4, 4))
        out.append(("moe", f"shared gate_up {tag} BLOCK_N 32", experts.shared_gate_up_kernel, up,
                    dict(TOP_K=8, HAS_SLOTS=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, **half), 4, 4))
        out.append(("moe", f"shared down {tag} BLOCK_N 64", experts.shared_down_kernel, down,
                    dict(TOP_K=8, HAS_SLOTS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, **half), 4, 4))
        out.append(("moe", f"prefill gate_up {tag} 64 x 64", prefill.gate_up_rows_kernel, {**up, "x_ptr": "*fp16"},
                    dict(TOP_K=8, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, **half), 4, 3))
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "b_ptr", "f_ptr", "g_ptr", "conv_ptr", "out_ptr", "win_ptr")}
    ptrs.update({n: "*fp32" for n in ("conv_w_ptr", "a_log_ptr", "dt_bias_ptr", "norm_w_ptr", "state_ptr", "part_ptr",
                                      "vk_ptr", "vv_ptr", "vg_ptr", "vb_ptr")})
    ptrs["index_ptr"] = "*i64"
    for block_v, warps, q, verify in ((128, 4, 1, False), (128, 8, 1, False), (64, 4, 1, False), (32, 4, 1, False),
                                      (128, 4, 4, True)):
        out.append(("kda", f"decode BLOCK_V {block_v} {warps} warps q {q}" + (" verify" if verify else ""),
                    kda.kda_decode_kernel, ptrs, dict(Q=q, K=128, V=128, KEEP=3, TAPS=4, BLOCK_V=block_v, VERIFY=verify),
                    warps, 3))
    att = {n: "*i64" for n in ("sel_ptr", "pos_ptr", "slot_ptr", "seq_ptr")}
    att.update(qlat_ptr="*bf16", lat_ptr="*bf16", count_ptr="*i32", tab_ptr="*i32", rows_ptr="*i32", acc_ptr="*fp32",
               ml_ptr="*fp32")
    for heads, bn, warps, chunk in ((16, 32, 4, 64), (64, 64, 8, 2048)):  # one token (33 splits), 64 (2) (plan_dsa)
        out.append(("dsa", f"attend {heads} heads BLOCK_N {bn} {warps} warps", dsa_attention.attend_kernel, att,
                    dict(KS=512, KP=4, BS=64, HEADS=heads, RP=512, BLOCK_N=bn, CHUNK=chunk, SPLIT=True, IEEE=False),
                    warps, 3))
    for w, tag in (("*bf16", "bf16"), ("*fp8e4nv", "fp8")):  # absorb (64 tokens) and value-up (plan_dsa's tiles)
        hp = dict(x_ptr="*bf16", slot_ptr="*i64", w_ptr=w, scale_ptr="*fp32", out_ptr="*bf16")
        for name, bk, bn in (("absorb", 64, 128), ("value-up", 64, 32)):
            out.append(("dsa", f"{name} {tag} BLOCK_K {bk} BLOCK_N {bn}", dsa_attention.head_product_kernel,
                        {**hp, "out_ptr": "*bf16" if name == "absorb" else "*fp32"},
                        dict(BLOCK_M=64, BLOCK_K=bk, BLOCK_N=bn, SCALED=tag == "fp8", IEEE=False, EARLY=False), 4, 3))
    for stages in (4, 8):  # the value-up's K steps all in flight (DsaPlan.up_stages), one token and 64
        for bm in (16, 64):
            out.append(("dsa", f"value-up fp8 BLOCK_M {bm} {stages} stages", dsa_attention.head_product_kernel,
                        dict(x_ptr="*bf16", slot_ptr="*i64", w_ptr="*fp8e4nv", scale_ptr="*fp32", out_ptr="*fp32"),
                        dict(BLOCK_M=bm, BLOCK_K=64, BLOCK_N=32, SCALED=True, IEEE=False, EARLY=False), 4, stages))
    out.append(("dsa", "absorb fp8, early (beside the selection)", dsa_attention.head_product_kernel,
                dict(x_ptr="*bf16", slot_ptr="*i64", w_ptr="*fp8e4nv", scale_ptr="*fp32", out_ptr="*bf16"),
                dict(BLOCK_M=16, BLOCK_K=64, BLOCK_N=128, SCALED=True, IEEE=False, EARLY=True), 4, 3))
    sel = dict(src_ptr="*fp32", src_key_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64", dst_ptr="*i64", dst_key_ptr="*i64",
               count_ptr="*i32")
    for pdl in (False, True):
        out.append(("dsa", "select 4096 entries, final level" + (", PDL" if pdl else ""), dsa_indexer.select_pools_kernel,
                    sel, dict(K=512, KP=4, BLOCK=4096, W=512, WB=512, KB=512, FROM_SCORES=True, FINAL=True, PDL=pdl),
                    8, 3))
    return out


def ptx_hash(ptx: str) -> str:
    """A hash of the PTX without its debug section, line records and temporary labels."""
    body = ptx.split(".section\t.debug")[0]
    lines = [re.sub(r"\$L__tmp\d+", "", line) for line in body.splitlines()
             if not line.strip().startswith((".loc", ".file", "//", "$L__tmp"))]
    return hashlib.md5("\n".join(lines).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("moe", "kda", "dsa"), default=None)
    ap.add_argument("--ptx-hash", action="store_true")
    ap.add_argument("--no-specialise", dest="specialise", action="store_false",
                    help="compile without the launch's divisibility (as before s46)")
    args = ap.parse_args()
    for group, name, fn, pointers, consts, warps, stages in cases():
        if args.only and group != args.only:
            continue
        try:
            src = ASTSource(fn=fn, signature=signature(fn, pointers, consts), constexprs=consts,
                            attrs=attributes(fn, pointers, consts) if args.specialise else None)
            k = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
        except Exception as e:  # noqa: BLE001 - a plan the compiler refuses is the finding
            print(f"{group:4} {name:44} does not compile: {type(e).__name__}: {str(e).splitlines()[-1][:120]}")
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
        extra = f"  ptx {ptx_hash(k.asm['ptx'])}" if args.ptx_hash else ""
        print(f"{group:4} {name:44} registers {found.get('REG', '?'):>3}  spill stack {found.get('STACK', '?'):>5} B  "
              f"shared memory {k.metadata.shared:>6} B{extra}")


if __name__ == "__main__":
    main()
