"""slime_async: asynchronous off-policy RL for LLM post-training.

Importing the package is cheap: nothing here pulls in torch, megatron or zmq.
"""

__version__ = "0.1.0"
