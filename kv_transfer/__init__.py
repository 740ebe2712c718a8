"""KV block transfer between workers over NIXL: agents, handshake, leases, transfer state.

Import the pieces from their modules (`kv_transfer.agent.KVTransferAgent`,
`kv_transfer.messages.KVReady`, ...); importing this package loads neither NIXL nor torch.
See README.md for the reading order.
"""
