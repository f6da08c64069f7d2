"""Drop-in Equinox layers on pimlayers' shared math (``pimlayers.layers``).

``Linear``, ``RMSNorm``, ``LlamaMLP``, ``Attention``: the constructor arguments, field names and
shapes of ``equinox.nn`` (``weight`` is (out, in), calls take one unbatched example and ``*, key``).
``layer(x)`` returns the output like the stock layer; ``layer.with_report(x)`` returns
``(y, FaultReport)``. Injected faults are a field (``faults``), i.e. data in the pytree.
"""

from ._layers import Attention as Attention
from ._layers import Linear as Linear
from ._layers import LlamaMLP as LlamaMLP
from ._layers import RMSNorm as RMSNorm

__all__ = ["Attention", "Linear", "LlamaMLP", "RMSNorm"]
