"""What runs on the client side: the ``vllama`` client commands and ``vllama batch``."""
