"""Code shared by the Sluice gateway and workers: config, wire protocol, error codes.

Imports neither aiohttp nor torch nor cupy (DESIGN.md, Processes).
"""
