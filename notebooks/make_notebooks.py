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
    print("wrote", sorted(p.name for p in HERE.glob("*.ipynb")))
