"""Routed (context-parallel) attention over a modelled optical interconnect.

routed_attention(q, k, v, *, mesh, axis, ...)   ring / bidirectional ring / torus / all-gather
                                                attention with checksummed, rerouted KV transfers
RouteReport                                     what the transfers went through
PhotonicMesh, LinkState                         the link model (static) and its health (data)
layout_permutation                              the token order of a causal load-balancing layout
local_attention                                 the per-device kernel alone (one device, no routing)
simulate                                        step-time estimates on a PhotonicMesh
"""

from . import simulate as simulate
from .attention import LAYOUTS as LAYOUTS
from .attention import SCHEDULES as SCHEDULES
from .attention import RouteReport as RouteReport
from .attention import layout_permutation as layout_permutation
from .attention import local_attention as local_attention
from .attention import routed_attention as routed_attention
from .links import LinkState as LinkState
from .links import PhotonicMesh as PhotonicMesh
