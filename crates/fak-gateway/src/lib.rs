//! fak-gateway: fak's HTTP APIs over a fak-engine driver (in progress).
