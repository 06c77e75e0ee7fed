//! What the `fak serve` tests share: a server child that is killed on drop, started from
//! a prepared command.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

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
