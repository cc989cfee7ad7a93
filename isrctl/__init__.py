"""isrctl: the ISR client — runs a parcel's VM under QEMU and moves its state between PCs."""
