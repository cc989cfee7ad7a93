"""The ISR parcel format: chunks, keyrings, sealed blobs, key envelopes, manifests and stores."""
