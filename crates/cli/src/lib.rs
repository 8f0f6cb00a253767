//! ferrovirt-cli (see docs/ARCHITECTURE.md).
