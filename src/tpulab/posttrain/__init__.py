"""Post-training stages that need generation (layer 8: above inference and train).

``pairs``: preference pairs sampled from a policy and labelled on the gold reward (``tpulab
pairs``); ``winrate``: the gold-reward win rate of one policy's greedy replies against another's
(``tpulab win-rate``).
"""
