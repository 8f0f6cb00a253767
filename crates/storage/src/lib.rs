//! ferrovirt-storage (see docs/ARCHITECTURE.md).
