"""Development on one machine: emulators, moto patches, producer, demo, fault harness."""
