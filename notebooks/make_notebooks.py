"""Writes the notebooks in this folder from the cell sources below (outputs cleared).

    python notebooks/make_notebooks.py        # after editing a cell here

Each notebook reads PIMLAYERS_NOTEBOOK_SMALL=1 (set by the test suite) to run at a size that suits a
two-core CI machine; without it, the sizes are the interesting ones.
"""

from __future__ import annotations

import pathlib

import nbformat

HERE = pathlib.Path(__file__).resolve().parent

SETUP = """import os, sys, pathlib
root = pathlib.Path.cwd()
while not (root / "pimlayers").is_dir() and root != root.parent:
    root = root.parent
sys.path.insert(0, str(root)); os.chdir(root)
SMALL = os.environ.get("PIMLAYERS_NOTEBOOK_SMALL") == "1"
import jax, jax.numpy as jnp, numpy as np
import matplotlib.pyplot as plt
print(jax.devices())"""

LAYERS = [
    (
        "md",
        """# Layers and ABFT: inject, detect, correct

A pimlayers `LlamaMLP` is a drop-in Flax NNX module whose three GEMMs are checked with Huang–Abraham
checksums. Here we flip bits in its GEMM outputs — inside the compiled computation, as a faulty matrix
unit would — and watch the checks find and repair them.""",
    ),
    ("code", SETUP),
    (
        "code",
        """from flax import nnx
from pimlayers.faults import GemmFaults
from pimlayers.flax import nnx as pnnx

dim, hidden, tokens = (64, 160, 32) if SMALL else (1024, 3584, 256)
mlp = pnnx.LlamaMLP(dim, hidden, rngs=nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (tokens, dim))
fwd = nnx.jit(lambda m, x: m(x))
clean = fwd(mlp, x)
print(pnnx.fault_report(mlp).summary())""",
    ),
    (
        "code",
        """# 8 candidate sites in the up-projection's output, each firing; random bits of the f32 accumulator.
rows = []
for bit in range(4, 32, 3):
    pnnx.inject(mlp, {"up": GemmFaults.random(jax.random.key(bit), (tokens, hidden), sites=8, bit=bit)})
    y = fwd(mlp, x)
    r = pnnx.fault_report(mlp)
    rows.append((bit, int(r.gemm_detected), int(r.gemm_corrected), int(r.gemm_uncorrectable),
                 float(jnp.max(jnp.abs(y - clean)))))
pnnx.inject(mlp, None)
print(f"{'bit':>4} {'detected':>9} {'corrected':>10} {'uncorr.':>8} {'max |y - clean|':>16}")
for row in rows:
    print(f"{row[0]:>4} {row[1]:>9} {row[2]:>10} {row[3]:>8} {row[4]:>16.2e}")""",
    ),
    (
        "md",
        """Low mantissa bits change a value by less than the rounding error the checksum must tolerate:
they pass unflagged, and the output stays within that bound. From the upper mantissa bits on, every
flip is detected and corrected in place or by recomputing the GEMM, and the output equals the clean
one. With 8 sites in a small output, two flips can land in one row. Their weighted checksum then no
longer fits one error at one column (the check tests that fit before it corrects anything), so the
block is not "corrected" but recomputed — it counts as detected and corrected, never uncorrectable.""",
    ),
    (
        "code",
        """bits, _, _, _, err = zip(*rows)
plt.figure(figsize=(6, 3))
plt.semilogy(bits, np.maximum(err, 1e-12), "o-")
plt.xlabel("flipped bit of the f32 accumulator"); plt.ylabel("max |output - clean|")
plt.title("protected MLP output after 8 injected flips"); plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## What a check cannot locate: recomputed, with or without a branch

Two errors in one checksum block fit no single column, so the block is recomputed. The loop
(`FaultPolicy(recompute_kernel=False)`, the default on a CPU) recomputes the whole GEMM in a loop of
0 or 1 trips; on a GPU the host reads that loop's predicate after every protected GEMM, faults or
not. The device kernel (bf16/f16; the default on NVIDIA GPUs of compute capability 8.0 or newer,
forced here with `recompute_kernel=True`) instead launches one kernel over every tile that computes
only the detected blocks and checks them again: no branch at all. On a CPU the kernel runs under
Pallas' interpreter; the program a GPU would run is lowered here to count its loops.""",
    ),
    (
        "code",
        """from pimlayers import FaultPolicy, ops

xb = jax.random.normal(jax.random.key(5), (256, 512)).astype(jnp.bfloat16)
wb = (jax.random.normal(jax.random.key(6), (512, 384)) / np.sqrt(512)).astype(jnp.bfloat16)
clean_b = np.asarray(jnp.matmul(xb, wb, preferred_element_type=jnp.float32))
# Two values of row 7's first 128-column block with exponent 127: their exponent's top bit flipped
# turns both into NaN (gated, then recomputed).
row = 7
cols = np.flatnonzero((np.abs(clean_b[row, :128]) >= 1.1) & (np.abs(clean_b[row, :128]) < 1.9))[:2]
two = GemmFaults(jnp.array([row, row]), jnp.asarray(cols), jnp.array([30, 30]), jnp.array([True, True]))
# y is bf16: "max |y - f32|" is its distance from the f32 product, one bf16 rounding when repaired.
head = ("recompute", 16), ("detected", 9), ("recomputed", 11), ("uncorr.", 8), ("max |y - f32|", 14)
print(" ".join(f"{h:>{w}}" for h, w in head), f"{'GPU loops':>10}")
for name, k in (("loop", False), ("device kernel", True)):
    pol = FaultPolicy(recompute_kernel=k)
    y, r = jax.jit(lambda a, b, f, p=pol: ops.protected_matmul(a, b, policy=p, faults=f))(xb, wb, two)
    gpu = jax.jit(lambda a, b, p=pol: ops.protected_matmul(a, b, policy=p)[0]).trace(xb, wb)
    loops = gpu.lower(lowering_platforms=("cuda",)).as_text().count("stablehlo.while")
    err = float(np.max(np.abs(np.asarray(y, np.float32) - clean_b)))
    print(f"{name:>16} {int(r.gemm_detected):>9} {int(r.gemm_recomputed):>11} {int(r.gemm_uncorrectable):>8} "
          f"{err:>14.3g} {loops:>10}")""",
    ),
    (
        "md",
        """## Fewer check columns: the plain checksums alone

Each 128-column block carries two checks: the plain sum c1 = x·Σ w_j and the position-weighted
c2 = x·Σ (j+1) w_j, which locates a single error (r2 / r1 names its column) and catches two errors
that cancel in the plain sum when they are large and far enough apart (|e|·|j_a - j_b| beyond c2's
bound, 128 times c1's). On a GPU both are GEMM columns over x, three bf16 terms each, beside one for
the bound's magnitude: 7 columns a block, paid on every call. `FaultPolicy(weighted_checks=False,
locate=False)` forms c1 alone (4 columns): every detected block is then recomputed, and a cancelling
pair passes. Below: the columns of the check GEMMs a GPU runs, the pair, and the same two NaNs as
above recomputed.""",
    ),
    (
        "code",
        """plain = FaultPolicy(weighted_checks=False, locate=False)
enc = ops.abft_encode(wb, 128)

def dot_columns(jaxpr):  # output columns of every dot in a traced program, nested ones included
    total = 0
    for e in jaxpr.eqns:
        total += e.outvars[0].aval.shape[-1] if e.primitive.name == "dot_general" else 0
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                total += dot_columns(inner) if hasattr(inner, "eqns") else 0
    return total

for weighted in (True, False):
    fn = lambda a, w=weighted: ops.abft_checks(a, enc, lam=8.0, weighted=w, impl="reference")
    cols_ = dot_columns(jax.make_jaxpr(fn)(xb).jaxpr)
    print(f"weighted_checks={weighted!s:5}: check-GEMM columns {cols_} for {enc.abs_sums.shape[-1]} blocks")
# +8 and -8 in one block of an f32 product: r1 stays within its bound B1; r2 = (3 - 100) * 8 is far
# beyond c2's, 128 B1 (a pair closer together or smaller passes c2 too).
xf, wf = xb.astype(jnp.float32), wb.astype(jnp.float32)
yf = jnp.matmul(xf, wf, precision="highest")
pair = yf.at[5, 3].add(8.0).at[5, 100].add(-8.0)
for weighted in (True, False):
    c, mag = ops.abft_checks(xf, ops.abft_encode(wf, 128), weighted=weighted)
    _, flags, _ = ops.abft_finish(pair, c, mag, k=512, block_n=128, correct=False, weighted=weighted)
    print(f"weighted_checks={weighted!s:5}: the cancelling pair's block flagged: {bool(flags[5, 0])}")
y, r = jax.jit(lambda a, b, f: ops.protected_matmul(a, b, policy=plain, faults=f))(xb, wb, two)
print("two NaNs under the plain checks:", r.summary())""",
    ),
    (
        "md",
        """## Attention: the checks inside a flash kernel

With protection on, `attention_core` runs flash attention on a Hopper GPU (`ops.flash_attention`), with
both of its GEMMs verified inside the kernel: per block of keys, each query row's scores must sum to
q·ksum, and the output rows must sum to p·vsum. The kernel writes, per row, the ratio of each
difference to its rounding bound; a row above 1 was hit by a fault, and the core reruns the kernel.
Elsewhere `flash=True` runs the same checks through the kernel's XLA reference, as here on a CPU.""",
    ),
    (
        "code",
        """from pimlayers import layers as L, ops

b, t, h, kv, d = (1, 256, 4, 2, 64) if SMALL else (1, 2048, 8, 2, 128)
kq, kk, kv_ = jax.random.split(jax.random.key(2), 3)
q = jax.random.normal(kq, (b, t, h, d)).astype(jnp.bfloat16)
k = jax.random.normal(kk, (b, t, kv, d)).astype(jnp.bfloat16)
v = jax.random.normal(kv_, (b, t, kv, d)).astype(jnp.bfloat16)
flash = ops.flash_attention if ops._fused_gemm.hopper() else ops.flash_attention_reference
_, _, clean_checks = flash(q, k, v)
# One exponent flip in a score of head 1, row t // 2, and one in the output accumulator of head 1, row t // 4.
sb, sk, ob, oc = (np.array(a) for a in ops.FlashFaults.none(b, h, t))
sb[0, 1, t // 2], sk[0, 1, t // 2] = 27, t // 3
ob[0, 1, t // 4], oc[0, 1, t // 4] = 27, 5
_, _, hit = flash(q, k, v, ops.FlashFaults(*(jnp.asarray(a) for a in (sb, sk, ob, oc))))
fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, name in zip(axes, ("scores", "out")):
    ax.semilogy(np.maximum(np.asarray(getattr(clean_checks, name))[0, 1], 1e-8), ".", ms=2, label="clean")
    ax.semilogy(np.minimum(np.asarray(getattr(hit, name))[0, 1], 1e9), "x", ms=4, label="one flipped bit")
    ax.axhline(1.0, color="k", lw=0.8); ax.set_xlabel("query row (head 1)"); ax.set_title(f"{name} check")
axes[0].set_ylabel("|difference| / bound"); axes[0].legend(); plt.tight_layout(); plt.show()""",
    ),
    (
        "code",
        """# The layer: the same kind of fault, at random sites of the scores GEMM, detected and recomputed.
out_clean, _ = L.attention_core(q, k, v, flash=True)
f = GemmFaults.random(jax.random.key(3), (b * h * t, t), sites=4, bit=30)
run = jax.jit(lambda q, k, v, f: L.attention_core(q, k, v, flash=True, faults={"scores": f}))
out, report = run(q, k, v, f)
print(report.summary())
diff = jnp.abs(out.astype(jnp.float32) - out_clean.astype(jnp.float32))
print("max |out - clean|:", float(jnp.max(diff)))""",
    ),
    (
        "md",
        """The backward pass (`ops.flash_attention_bwd`) runs two kernels from the forward's output and
logsumexp, one per block of query rows (dq) and one per block of key rows (dk, dv), and checks all
seven of their GEMMs the same way: three per query row, four per key row. One bit flipped in dk's
accumulator at key row t // 3 shows up in dk's check of that row alone.""",
    ),
    (
        "code",
        """bwd = ops.flash_attention_bwd if ops._fused_gemm.hopper() else ops.flash_attention_bwd_reference
out, lse, _ = flash(q, k, v)
dout = jax.random.normal(jax.random.key(4), q.shape).astype(jnp.bfloat16)
*_, clean_bwd = bwd(q, k, v, out, lse, dout)
bits, cols = np.full((b, kv, t), -1, np.int32), np.zeros((b, kv, t), np.int32)
bits[0, 1, t // 3], cols[0, 1, t // 3] = 27, 7
*_, hit_bwd = bwd(q, k, v, out, lse, dout, ops.FlashBwdFaults(dk=(jnp.asarray(bits), jnp.asarray(cols))))
fig, axes = plt.subplots(1, 7, figsize=(16, 2.8), sharey=True)
for ax, name in zip(axes, ops.FlashBwdChecks._fields):
    row = "query" if name in ("scores", "dp", "dq") else "key"
    ax.semilogy(np.maximum(np.asarray(getattr(clean_bwd, name))[0, 1], 1e-8), ".", ms=2, label="clean")
    ax.semilogy(np.minimum(np.asarray(getattr(hit_bwd, name))[0, 1], 1e9), "x", ms=3, label="dk bit flipped")
    ax.axhline(1.0, color="k", lw=0.8); ax.set_title(name); ax.set_xlabel(f"{row} row (head 1)")
axes[0].set_ylabel("|difference| / bound"); axes[-1].legend(fontsize=7); plt.tight_layout(); plt.show()""",
    ),
    ("md", "## One line for an existing model: `pimlayers.protect`"),
    (
        "code",
        """import pimlayers as pl

class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, rngs=rngs)
    def __call__(self, x):
        return x + self.down(jax.nn.silu(self.up(self.norm(x))))

stock = Block(nnx.Rngs(0))
with jax.default_matmul_precision("highest"):
    before = stock(x)
protected = pl.protect(stock)            # same weights, verified GEMMs
after = protected(x)
print("max difference after protect():", float(jnp.max(jnp.abs(after - before))))
print(pnnx.fault_report(protected).summary())""",
    ),
]

MEMORY = [
    (
        "md",
        """# Parameter memory: bit flips, a failed bank, repair

A `PimStore` keeps checksums and parity for a parameter pytree, laid out over an HBM bank geometry.
We protect a Llama 3 model's parameters, break them in place (behind XLA's back), look at the fault
table as a heat map of physical banks, and repair — bit-exactly.""",
    ),
    ("code", SETUP),
    (
        "code",
        """from flax import nnx
from models.llama3 import Llama3, get_config
from pimlayers import faults
from pimlayers.memory import BankGeometry, PimStore

cfg = get_config("llama3_tiny") if SMALL else get_config("llama3_small")
params = nnx.state(Llama3(cfg, rngs=nnx.Rngs(0)), nnx.Param)
geo = BankGeometry(stacks=2, pseudo_channels=8, bank_groups=4, banks_per_group=4, stripe_bytes=1024, group=8)
store = PimStore(params, geo)
state = store.encode(params)
clean = [np.asarray(v).copy() for v in jax.tree.leaves(params)]
print(store)
print({k: round(v, 4) if isinstance(v, float) else v for k, v in store.overhead().items()})""",
    ),
    (
        "code",
        """# Interleaving: how many different tensors have stripes in each physical bank.
per_bank = store.address_map.leaves_per_bank()
plt.figure(figsize=(6, 2.5)); plt.bar(range(geo.nbanks), per_bank, width=1.0)
plt.xlabel("physical bank"); plt.ylabel("tensors"); plt.title("tensors with data in each bank")
plt.tight_layout(); plt.show()""",
    ),
    (
        "code",
        """def heat(table, title):
    rows, cols = geo.banks_per_group * geo.bank_groups, geo.pseudo_channels * geo.stacks
    t = np.asarray(table)[0].reshape(rows, cols)
    plt.figure(figsize=(6, 3)); plt.imshow(t, cmap="Reds", vmin=0); plt.colorbar(label="faulty stripes")
    plt.xlabel("stack x pseudo-channel"); plt.ylabel("bank group x bank")
    plt.title(title); plt.tight_layout(); plt.show()

flips = faults.random_bit_flips(store, params, 40 if SMALL else 200, seed=0)
found = store.scrub(params, state)
print(found.report.summary())
heat(found.bank_faults, f"{len(flips)} random bit flips")""",
    ),
    (
        "code",
        """out = store.repair(params, state)
params, state = out.params, out.state
print(out.report.summary())
print("bit-exact:", all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(params), clean)))""",
    ),
    (
        "code",
        """bank = 37
hit = faults.fail_bank(store, params, state, bank)
found = store.scrub(params, state)
print(f"bank {bank} held {hit} stripes; located:", store.faulty_banks(found))
heat(found.bank_faults, f"bank {bank} failed")
out = store.repair(params, state)
params, state = out.params, out.state
print(out.report.summary())
print("bit-exact:", all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(params), clean)))""",
    ),
    (
        "md",
        """Two faults in one parity group cannot be rebuilt: the store says so and leaves them flagged.""",
    ),
    (
        "code",
        """w = max(jax.tree.leaves(params), key=lambda a: a.size)
faults.flip_bits(w, [0, geo.stripe_bytes + 5], [3, 3])   # stripes 0 and 1: one parity group
out = store.repair(params, state)
params, state = out.params, out.state
r = out.report
print(f"faulty {int(r.banks_faulty)}, repaired {int(r.banks_repaired)}, "
      f"uncorrectable {int(r.banks_uncorrectable)}")""",
    ),
    (
        "md",
        """## Encode on write, inside the optimizer's step

Every optimizer step writes every parameter, and the new values need their checksums and parity
before anything reads them. `pimlayers.optim.adamw_guarded` is optax's AdamW (clipped, under the
fault-aware skip) whose `update_and_guard` takes the step and the store's encode in one pass: on a GPU
the update's own kernel forms the checksums and parity from the values it writes, instead of reading
all the parameters again. Here (a CPU) the same function runs XLA's update, then the encode; either
way the result is optax's step, and the protection data is that of the parameters just written.""",
    ),
    (
        "code",
        """import optax
from pimlayers.optim import adamw_guarded

# Start again from the clean parameters (the last cell left two uncorrectable faults in place).
params = jax.tree_util.tree_unflatten(jax.tree.structure(params), [jnp.asarray(c) for c in clean])
state = store.encode(params)
opt = adamw_guarded(1e-3, weight_decay=0.1, clip=1.0)
opt_state = opt.init(params)
grads = jax.tree.map(lambda p: 0.01 * jnp.sin(3.0 * p), params)

fused = jax.jit(lambda p, s, g: opt.update_and_guard(g, s, p, store))
def unfused(p, s, g):  # optax's step, then the encode
    u, s2 = opt.update(g, s, p)
    p2 = optax.apply_updates(p, u)
    return p2, s2, store.encode(p2)

a = jax.jit(unfused)(params, opt_state, grads)
params, opt_state, state = fused(params, opt_state, grads)
ulps = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / np.spacing(np.abs(np.asarray(y)))))
           for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(params)))
print(f"parameters against optax's step: at most {ulps:.0f} ulp apart")
print("after the step:", store.scrub(params, state).report.summary())
flips = faults.random_bit_flips(store, params, 5, seed=1)
out = store.repair(params, state)
params, state = out.params, out.state
print("5 flips after the step:", out.report.summary())""",
    ),
]

TRAIN = [
    (
        "md",
        """# Training under faults, with and without protection

`train.llama3.train` runs the training script in-process. One run is protected and has faults injected
(GEMM output flips, parameter bit flips, NaN bursts); the other runs stock arithmetic with no faults.
If protection works, the two loss curves lie on top of each other.""",
    ),
    ("code", SETUP),
    (
        "code",
        """import dataclasses
from train import llama3 as T

steps = 40 if SMALL else 400
cfg = T.TrainConfig(config="llama3_tiny" if SMALL else "llama3_small", steps=steps, batch=8,
                    seq=64 if SMALL else 128, max_bytes=300_000 if SMALL else 3_000_000,
                    eval_every=max(steps // 4, 1), devices=1, out_dir="runs/notebook", quiet=True,
                    gemm_fault_rate=0.3, flip_every=5, flips=2, nan_rate=0.05)
faulty = T.train(cfg)
clean = T.train(dataclasses.replace(cfg, protect=False, gemm_fault_rate=0.0, flip_every=0, nan_rate=0.0,
                                    out_dir="runs/notebook/baseline"))
print(T.fault_table(faulty))""",
    ),
    (
        "code",
        """fig, ax = plt.subplots(figsize=(7, 3.5))
for run, label in ((faulty, "protected, faults injected"), (clean, "stock, no faults")):
    s, l = zip(*run["curve"]); ax.plot(s, l, lw=1, label=label)
    if run["evals"]:
        es, el = zip(*run["evals"]); ax.plot(es, el, "o", label=f"held out ({label})")
ax.axhline(faulty["unigram_cross_entropy"], ls="--", color="grey", label="unigram cross-entropy")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(fontsize=8); plt.tight_layout(); plt.show()
print(f"held-out loss: protected+faults {faulty['final_eval_loss']:.3f}, "
      f"stock {clean['final_eval_loss']:.3f}")""",
    ),
]


ROUTING = [
    (
        "md",
        """# Routed attention over a modelled photonic interconnect

Context-parallel attention shards the sequence over devices and passes key/value blocks around a
ring. `pimlayers.routing.routed_attention` checksums every block in flight, lets a `PhotonicMesh`
decide (inside the compiled step, from data) which transfers arrive corrupted or not at all, fetches
failed blocks again — over another route when a link is dead — and reports what it could not fetch.
Here: 8 simulated CPU devices, fault rates up to 88%, dead links, and the step-time simulator.""",
    ),
    (
        "code",
        """import os, sys, pathlib
# 8 CPU devices, set before jax starts (added to any XLA flags already set)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
root = pathlib.Path.cwd()
while not (root / "pimlayers").is_dir() and root != root.parent:
    root = root.parent
sys.path.insert(0, str(root)); os.chdir(root)
SMALL = os.environ.get("PIMLAYERS_NOTEBOOK_SMALL") == "1"
import jax, jax.numpy as jnp, numpy as np
import matplotlib.pyplot as plt
from jax.sharding import Mesh
from pimlayers.routing import PhotonicMesh, routed_attention, simulate
cpus = jax.devices("cpu")
mesh = Mesh(np.array(cpus[:8]), ("seq",))
print(mesh)""",
    ),
    (
        "code",
        """B, T, H, KV, D = (1, 128, 4, 2, 16) if SMALL else (1, 1024, 8, 2, 64)
ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (B, T, H, D)); k = jax.random.normal(ks[1], (B, T, KV, D))
v = jax.random.normal(ks[2], (B, T, KV, D))
pm = PhotonicMesh((8,))
attend = jax.jit(lambda q, k, v, links: routed_attention(q, k, v, mesh=mesh, axis="seq", links=links))
clean, rep = attend(q, k, v, pm.state(fault_rate=0.0))
ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
print("max |routed - jax.nn.dot_product_attention| =", float(jnp.max(jnp.abs(clean - ref))))
print(rep.faults.summary())""",
    ),
    (
        "md",
        """## Fault rates up to 88%

Every call draws new faults (the `step` argument); the compiled step is the same one each time.""",
    ),
    (
        "code",
        """rates, iters = [0.0, 0.3, 0.6, 0.88], 5 if SMALL else 20
stats = []
for rate in rates:
    r = dict(retries=0, corrupted=0, dropped=0, worst=0.0)
    for it in range(iters):
        out, rep = attend(q, k, v, pm.state(fault_rate=rate, seed=1, step=it))
        r["retries"] += int(rep.faults.link_retries); r["corrupted"] += int(rep.corrupted)
        r["dropped"] += int(rep.dropped)
        r["worst"] = max(r["worst"], float(jnp.max(jnp.abs(out - clean))))
        assert not bool(rep.incomplete.any())
    stats.append(r)
print("compiled programs:", attend._cache_size())
for rate, r in zip(rates, stats):
    print(f"fault rate {rate:4.0%}: retries/call {r['retries'] / iters:6.1f}, corrupted {r['corrupted']:5d}, "
          f"lost {r['dropped']:5d}, max |out - fault-free out| = {r['worst']}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar([f"{x:.0%}" for x in rates], [r["retries"] / iters for r in stats])
ax.set_xlabel("link fault rate"); ax.set_ylabel("retries per call"); plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## Dead links: detours, and what happens when no route survives

A dead link drops everything. With the clockwise link 2 → 3 dead, device 3's blocks come the long way
round. With both links into device 3 dead, nothing reaches it: the rows that needed a missing block
are reported in `report.incomplete`, and every other row is still exact.""",
    ),
    (
        "code",
        """short = PhotonicMesh((8,), max_attempts=6)
attend6 = jax.jit(lambda q, k, v, links: routed_attention(q, k, v, mesh=mesh, axis="seq", links=links))
out, rep = attend6(q, k, v, short.state(dead=[short.link_id(2, 0, +1)]))
print("link 2->3 dead: retries", int(rep.faults.link_retries),
      "max error", float(jnp.max(jnp.abs(out - ref))))
cut = [short.link_id(2, 0, +1), short.link_id(4, 0, -1)]
out, rep = attend6(q, k, v, short.state(dead=cut))
bad = np.asarray(rep.incomplete)
err = np.asarray(jnp.max(jnp.abs(out - ref), axis=(0, 2, 3)))
print("device 3 cut off: link failures", int(rep.faults.link_failures), "incomplete rows", int(bad.sum()),
      "| worst error on complete rows", float(err[~bad].max()))
fig, ax = plt.subplots(figsize=(7, 2.5))
ax.plot(err, lw=1, label="max |out - reference| per position")
ax.fill_between(np.arange(T), 0, err.max() * bad, color="red", alpha=0.2, label="reported incomplete")
ax.set_xlabel("token position"); ax.legend(fontsize=8); plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## The link model: thermal drift to fault probability

A microring's resonance drifts with temperature; a transfer fails when the phase error passes the
receiver's tolerance. Hotter links fail more often (`PhotonicMesh.fault_probability`).""",
    ),
    (
        "code",
        """dT = np.linspace(0, 6, 61)
fig, ax = plt.subplots(figsize=(6, 3))
ax.semilogy(dT, np.maximum(pm.fault_probability(dT), 1e-12))
ax.set_xlabel("ring detuning (K)"); ax.set_ylabel("fault probability per transfer")
plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## Simulator: ring vs all-gather vs rerouted, Llama-3-8B attention

Estimated forward time of one attention layer (32 query / 8 KV heads, D = 128, bf16) at 128k tokens,
at a sustained 400 TFLOP/s per device, over the default link (112 GB/s, 200 ns per hop). Same fault
model and route choice as the compiled step, by Monte Carlo.""",
    ),
    (
        "code",
        """kw = dict(batch=1, seq_len=131072, heads=32, kv_heads=8, head_dim=128, device_flops=400e12,
          draws=50 if SMALL else 200)
devices = [2, 4, 8, 16] if SMALL else [2, 4, 8, 16, 32, 64]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
ms = lambda n, **extra: simulate.estimate(PhotonicMesh((n,)), **kw, **extra).mean_s * 1e3
for sched in ("ring", "bidir", "allgather"):
    a1.plot(devices, [ms(n, schedule=sched) for n in devices], "o-", label=sched)
dead_one = [ms(n, schedule="ring", dead=[PhotonicMesh((n,)).link_id(0, 0, 1)]) for n in devices]
a1.plot(devices, dead_one, "s--", label="ring, one link dead (rerouted)")
a1.set_xscale("log", base=2); a1.set_yscale("log"); a1.set_xlabel("devices"); a1.set_ylabel("ms per layer")
a1.legend(fontsize=8)
faults = [0.0, 0.1, 0.3, 0.5, 0.7, 0.88]
for n in (8, 32) if not SMALL else (8,):
    a2.plot(faults, [ms(n, fault_rate=f) for f in faults], "o-", label=f"ring, {n} devices")
a2.set_xlabel("link fault rate"); a2.set_ylabel("ms per layer"); a2.legend(fontsize=8)
plt.tight_layout(); plt.show()""",
    ),
    (
        "md",
        """## Checking the simulator against measured times (8 CPU devices)

Calibrated by two microbenchmarks run right here (one round of block compute; one verified transfer
attempt), the simulator predicts the measured call times at each fault rate — this is
`python -m benchmarks.run --suite routing-sim` at a smaller size.""",
    ),
    (
        "code",
        """from benchmarks import routing as bench
# (small: the ring schedule alone; each schedule is one more compile of the 8-device program)
sched = bench.SIM_SCHEDULES[:1] if SMALL else bench.SIM_SCHEDULES
rows = bench.run_sim(t=256 if SMALL else 2048, h=4, kv=2, d=32, devices=cpus[:8], schedules=sched)
for r in rows:
    print(f"{r['schedule']:9s} faults {r['fault_rate']:4.0%}: measured {r['measured_ms']:8.2f} ms, "
          f"estimate {r['estimate_ms']:8.2f} ms ({r['estimate_over_measured']:.2f}x); "
          f"attempts measured {r['attempts_measured']:.0f}, estimated {r['attempts_estimate']:.0f}")""",
    ),
]


def write(name: str, cells) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(s) if k == "md" else nbformat.v4.new_code_cell(s) for k, s in cells
    ]
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("01_layers_and_abft.ipynb", LAYERS)
    write("02_parameter_memory.ipynb", MEMORY)
    write("03_training_under_faults.ipynb", TRAIN)
    write("04_routed_attention.ipynb", ROUTING)
    print("wrote", sorted(p.name for p in HERE.glob("*.ipynb")))
