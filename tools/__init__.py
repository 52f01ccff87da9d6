"""Tools over the library: inspect, bench, trace, profile and the replay manifest.

Imports run down the layers only: tools -> runtime -> codegen -> compiler -> dsl.
"""
