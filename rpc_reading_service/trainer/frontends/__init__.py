"""Front ends that need no DataLoader2: torch's DataLoader and StatefulDataLoader
(:class:`~.torch_dataloader.RemoteIterable`), over the engine like the DataLoader2 adapter.

Nothing is imported here: each front end loads with its own module.
"""
