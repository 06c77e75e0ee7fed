//! What the `fak serve` tests share: a server child that is killed on drop, started from
//! a prepared command; one-shot HTTP/1.1 requests to it; waiting for its `/health`.

#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `fak` binary under test.
pub fn fak() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fak"))
}

/// `fak serve --port 0 ARGS...`, started.
pub fn serve(args: &[&str]) -> Serve {
    Serve::spawn(fak().arg("serve").args(["--port", "0"]).args(args))
}

/// One HTTP/1.1 request; returns (status, body). The server answers with a
/// Content-Length body for JSON.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    http_with(addr, method, path, "", body)
}

/// [`http`] with extra header lines (each ending in `\r\n`).
pub fn http_with(addr: &str, method: &str, path: &str, extra: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let (head, body) = buf.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

/// Waits (up to 120 s, a real model's load) until `GET /health` answers 200.
pub fn wait_ready(addr: &str) {
    let t = Instant::now();
    while http(addr, "GET", "/health", "").0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(120), "never ready");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A `fak serve` child and the address it printed; killed on drop.
pub struct Serve {
    pub child: Child,
    pub addr: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    /// Starts `cmd` (a `fak serve ... --port 0` command), with stdout piped and stderr
    /// dropped, and reads the address from its first line (`listening on http://ADDR`).
    pub fn spawn(cmd: &mut Command) -> Serve {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        Serve { child, addr }
    }
}
