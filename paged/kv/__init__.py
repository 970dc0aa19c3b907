"""KV state: the device pool (``cache``: the ``KVCache`` pytree and its jitted writes, copies and
swaps), the host block manager that owns its pages (``block_manager`` over ``blocks/``, and
``group_manager`` for one table per KV-cache group), KV-cache groups (``groups``), the pool's
construction from the engine settings (``pools``) and the host-memory tier's slots (``host_store``).

Host modules here (everything but ``cache`` and ``host_store``) import no JAX.
"""
