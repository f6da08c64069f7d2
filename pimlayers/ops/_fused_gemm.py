"""fused_gemm: y = a @ b on Hopper's tensor cores with the ABFT block sums formed in the epilogue.

The unfused protected GEMM writes y and then reads it again to check it (abft_finish): on an H200 at
8192 x 4096 -> 14336 that second pass costs 0.14-0.16 ms against a 1.27 ms GEMM. Here the GEMM's own
epilogue, holding a 128 x 128 tile of the f32 accumulator in registers, sums it per row two ways
before rounding it to y (bf16):

    s1 = sum_j acc_ij,    s2 = sum_j (j+1) acc_ij      (j counted inside the 128-column tile)

written as a small (2, N / 128, M) f32 array next to y. The check then compares them with the checks
GEMM's ``c = x @ [w1, w2]`` (``_fused_check.fused_flags``): y is never read again. What is verified
is the accumulator, as classic ABFT does, so the bound is the f32 accumulation's alone, with no bf16
rounding term: about 3x sharper (K = 4096, random data) than the unfused check of a bf16 y, whose
bound must also cover 2^-8 of the block's sum of |y|. A fault in the accumulator corrupts y and the
sums alike, and the sums then disagree with c, which came from the operands by a separate GEMM.
The rounding to bf16 is one conversion per value after the sums; a value corrupted in memory after
the epilogue is outside this check (as it is outside any GEMM's).

Written with Pallas's Mosaic-GPU API (warp-specialised pipeline: one warpgroup feeds shared memory by
TMA, two compute warpgroups each own a 128 x 128 accumulator). Hopper (sm_90) only, bf16 operands,
M, N, K multiples of the tiles; ``fused_gemm_supported`` says when. Reference:
``fused_gemm_reference`` (the same quantities from XLA's GEMM).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, BFloat16, Float

__all__ = ["FusedConfig", "fused_gemm", "fused_gemm_reference", "fused_gemm_supported", "hopper"]

TILE = 128  # rows and columns of one warpgroup's accumulator tile = the ABFT block width


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Tiling of the fused GEMM. ``wg_m``: the CTA's two warpgroups stack along M (a 256 x 128 CTA
    tile) instead of N (128 x 256). ``minor_m`` / ``width``: the order tiles are visited in (a
    planar snake, ``width`` tiles wide, along M or N) — L2 reuse of the operands."""

    tile_k: int = 64
    # TMA pipeline depth (shared-memory buffers per operand). Four stages fit the H200's 227 KiB of
    # shared memory only beside a 64 x 32 epilogue tile; three with 64 x 64 measured faster at all
    # four Llama-3-8B shapes (M = 8192: 0.95-0.99x XLA's GEMM against 0.94-0.97x; first version of
    # the epilogue, three sums).
    stages: int = 3
    wg_m: bool = False
    minor_m: bool = True
    width: int = 16
    # Epilogue sub-tile staged through shared memory on its way to y (two slots per warpgroup).
    epi_m: int = 64
    epi_n: int = 64


def hopper() -> bool:
    """Whether JAX's first device is a Hopper GPU (sm_90), where the fused kernel runs."""
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


def fused_gemm_supported(m: int, k: int, n: int, dtype, config: FusedConfig | None = None) -> bool:
    """Shapes and dtype the kernel takes (on a Hopper GPU)."""
    cfg = config or FusedConfig()
    cta_m, cta_n = (2 * TILE, TILE) if cfg.wg_m else (TILE, 2 * TILE)
    return (
        jnp.dtype(dtype) == jnp.bfloat16
        and m > 0
        and m % cta_m == 0
        and n % cta_n == 0
        and k % cfg.tile_k == 0
        and k > 0
    )


def fused_gemm_reference(
    a: BFloat16[Array, "m k"], b: BFloat16[Array, "k n"], config: FusedConfig | None = None
) -> tuple[BFloat16[Array, "m n"], Float[Array, "2 nb m"]]:
    """The kernel's outputs computed by XLA: the f32 product's block sums, and y rounded once from it
    (``config``, the kernel's tiling, changes neither)."""
    del config
    acc = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    return acc.astype(jnp.bfloat16), block_sums(acc)


def block_sums(acc: Float[Array, "m n"]) -> Float[Array, "2 nb m"]:
    """s1, s2 of an f32 product per row and 128-column block, as (2, N / 128, M) (the kernel's layout)."""
    m, n = acc.shape
    yb = acc.astype(jnp.float32).reshape(m, n // TILE, TILE)
    j = jnp.arange(1, TILE + 1, dtype=jnp.float32).reshape(1, 1, TILE)
    s = jnp.stack([yb.sum(-1), (yb * j).sum(-1)])  # (2, M, nb)
    return jnp.swapaxes(s, 1, 2)


def fused_gemm(
    a: BFloat16[Array, "m k"], b: BFloat16[Array, "k n"], config: FusedConfig | None = None
) -> tuple[BFloat16[Array, "m n"], Float[Array, "2 nb m"]]:
    """``(y, sums)``: y = a @ b in bf16 and its block sums (module docstring), one Hopper kernel."""
    cfg = config or FusedConfig()
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"pimlayers.fused_gemm: a {a.shape} @ b {b.shape}; expected (M, K) @ (K, N)")
    if a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16:
        raise TypeError(f"pimlayers.fused_gemm: operands are {a.dtype}, {b.dtype}; expected bfloat16")
    m, k = a.shape
    n = b.shape[1]
    if not fused_gemm_supported(m, k, n, a.dtype, cfg):
        raise ValueError(
            f"pimlayers.fused_gemm: ({m}, {k}) @ ({k}, {n}) does not tile: M must be a multiple of "
            f"{2 * TILE if cfg.wg_m else TILE}, N of {TILE if cfg.wg_m else 2 * TILE}, K of {cfg.tile_k}"
        )
    if not hopper():
        raise NotImplementedError("pimlayers.fused_gemm runs on Hopper GPUs (sm_90) only")
    return _fused_call(a, b, cfg)


def _sm_count() -> int:
    """The persistent grid's CTAs: one per SM of the GPU (tests interpreting the kernel on a CPU,
    which has no SMs, set their own)."""
    return jax.devices()[0].core_count


@functools.partial(jax.jit, static_argnums=(2,))
def _fused_call(a, b, cfg: FusedConfig):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, k = a.shape
    n = b.shape[1]
    dtype = a.dtype
    tk, em, en = cfg.tile_k, cfg.epi_m, cfg.epi_n
    cta_m, cta_n = (2 * TILE, TILE) if cfg.wg_m else (TILE, 2 * TILE)
    m_iters, n_iters, k_iters = m // cta_m, n // cta_n, k // tk
    nb = n // TILE

    def transforms(minor_elems: int):
        swizzle = plgpu.find_swizzle(minor_elems * 16)  # bits of one row of bf16
        return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    in_t = transforms(tk)
    out_t = transforms(en)

    def body(a_gmem, b_gmem, y_gmem, s_gmem, y_smem, s_smem):
        def pipeline(step, finish):
            return plgpu.emit_pipeline_warp_specialized(
                step,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((cta_m, tk), lambda kk: (0, kk), transforms=in_t),
                    plgpu.BlockSpec((tk, cta_n), lambda kk: (kk, 0), transforms=in_t),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=cfg.stages,
                compute_context=finish,
            )

        nothing = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(nothing, nothing).get_allocations(a_gmem, b_gmem),
            collective_axes="wg",
        )
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 0 if cfg.minor_m else 1, cfg.width)
                rows = pl.ds(mi * cta_m, cta_m)
                cols = pl.ds(ni * cta_n, cta_n)
                if cfg.wg_m:
                    wg_rows, wg_cols = pl.ds(wg * TILE, TILE), slice(None)
                    row0, blk = mi * cta_m + wg * TILE, ni
                else:
                    wg_rows, wg_cols = slice(None), pl.ds(wg * TILE, TILE)
                    row0, blk = mi * cta_m, ni * 2 + wg

                def finish(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((TILE, TILE), jnp.float32))
                    def _acc(acc):
                        run(acc)
                        af = acc[...]
                        j1 = plgpu.broadcasted_iota(jnp.int32, (TILE, TILE), 1, layout=plgpu.Layout.WGMMA)
                        j1 = (j1 + 1).astype(jnp.float32)  # weights 1..128: exact in f32
                        # f32 sums of 128 terms in the layout's reduction order: their rounding is
                        # the sqrt(n) term of the check's bound (n = 128 columns).
                        s1 = af.sum(axis=1)
                        s2 = (af * j1).sum(axis=1)
                        yq = af.astype(dtype)
                        # Everything this warpgroup sent from shared memory before has been read.
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        mine = s_smem.at[wg]
                        mine.at[0][...] = s1
                        mine.at[1][...] = s2
                        plgpu.commit_smem()
                        for q in range(2):
                            plgpu.copy_smem_to_gmem(mine.at[q], s_gmem.at[q, blk, pl.ds(row0, TILE)])
                        for ei in range(TILE // em):
                            for ej in range(TILE // en):
                                slot = (ei * (TILE // en) + ej) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                y_smem[wg, slot] = yq[ei * em : (ei + 1) * em, ej * en : (ej + 1) * en]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    y_smem.at[wg, slot],
                                    y_gmem.at[rows, cols]
                                    .at[wg_rows, wg_cols]
                                    .at[pl.ds(ei * em, em), pl.ds(ej * en, en)],
                                )

                def step(_, a_smem, b_smem, acc):
                    plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem.at[:, wg_cols])
                    plgpu.wgmma_wait(0)
                    return acc

                pipeline(step, finish)(a_gmem.at[rows, :], b_gmem.at[:, cols], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    sms = _sm_count()
    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((m, n), dtype),
            jax.ShapeDtypeStruct((2, nb, m), jnp.float32),
        ),
        grid=(sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        scratch_types=(
            plgpu.SMEM((2, 2, em, en), dtype, transforms=out_t),
            plgpu.SMEM((2, 2, TILE), jnp.float32),
        ),
    )
    return kernel(a, b)
