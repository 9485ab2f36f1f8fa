"""The ``clone`` command's subcommands, one module per group (:mod:`clone.client.cli`
builds the parser and dispatches).

Each module has ``register(sub, common)``, which adds its subparsers (``common``:
the parent parser of the connection flags, so they may also follow the
subcommand) and sets ``handler`` on each: ``handler(args, client) -> exit code``
for a subcommand that needs a synced :class:`clone.Clone`.  Modules import the
client library inside their handlers only, so ``clone --help`` stays fast.
"""
