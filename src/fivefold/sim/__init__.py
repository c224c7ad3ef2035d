"""Cluster simulation beyond this machine: topologies, routing, a flow-level network and a rank engine.

topology.py builds fabrics (NVSwitch node, fat tree, rail-optimised, 2D torus); routing.py routes
flows (ECMP, ECMP with path variation, spraying); network.py shares link bandwidth max-min fairly
among flows; engine.py runs each rank's program of compute and messages as a discrete-event
simulation; trace.py records those programs from the runtime's own collective algorithms.
"""
