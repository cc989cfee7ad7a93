"""The ISR server: stores users' parcels (ciphertext only) and serves them over HTTPS.

Commands: ``isr-server`` (:mod:`server.main`) and ``isr-admin`` (:mod:`server.admin`). The HTTP API is
documented in ``doc/protocol.md``; configuration and operation in ``doc/server.md``.
"""
