//! Where the CPU backend's weight bytes live: a safetensors file read into anonymous memory that
//! Linux backs with 2 MiB transparent huge pages (`madvise(MADV_HUGEPAGE)`, kernel docs
//! `admin-guide/mm/transhuge`), instead of the file's 4 KiB page-cache pages mapped in place.
//!
//! A decode step reads every weight once, as a stream, so it runs at the memory's streaming rate,
//! and with 4 KiB pages that rate is set by address translation as much as by DRAM: a TLB miss
//! every 4 KiB, and the hardware prefetchers stop at each page boundary. Under a hypervisor
//! (nested paging, the cloud VMs this tool runs on) a miss costs up to 24 memory references.
//! Measured on this project's Zen 4 VM (2 threads, 1 GiB read loop): 29-31 GB/s over 4 KiB pages,
//! 55-60 GB/s over 2 MiB pages (docs/performance.md). GPU backends upload the weights once and
//! keep the mapped file; so does the CPU where huge pages are off (`never`) or not Linux.

use std::io::{self, Read};
use std::ops::{Deref, DerefMut};

/// How a model's safetensors files are held in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// The file mapped read-only in place: shared with the page cache (and with another `bot`
    /// on the same model), paged in as it is touched.
    Mapped,
    /// The file read into private anonymous memory advised for 2 MiB pages (Linux).
    HugePages,
}

/// The environment variable that turns the copy off (`BOT_HUGEPAGES=off`): two `bot`
/// processes on one large model then share its page cache instead of holding a copy each.
pub const ENV: &str = "BOT_HUGEPAGES";

impl Residency {
    /// `HugePages` for the CPU backend on Linux when the kernel's transparent huge pages are
    /// `always` or `madvise` and `BOT_HUGEPAGES` is not `off`; `Mapped` otherwise.
    pub fn for_device(dev: &candle_core::Device) -> Self {
        if !dev.is_cpu() || std::env::var(ENV).is_ok_and(|v| v == "off" || v == "0") {
            return Residency::Mapped;
        }
        match thp_mode().as_deref() {
            Some("always" | "madvise") => Residency::HugePages,
            _ => Residency::Mapped,
        }
    }
}

/// What the CPU backend does with a model's files here, in words (`bot doctor`).
pub fn describe_cpu() -> String {
    let mode = thp_mode();
    match Residency::for_device(&candle_core::Device::Cpu) {
        Residency::HugePages => format!(
            "read into 2 MiB pages (transparent huge pages: {}; {ENV}=off maps the files instead)",
            mode.as_deref().unwrap_or("?")
        ),
        Residency::Mapped if std::env::var_os(ENV).is_some() => {
            format!("the files mapped in place ({ENV} is set)")
        }
        Residency::Mapped => match mode {
            Some(m) => format!("the files mapped in place (transparent huge pages: {m})"),
            None => "the files mapped in place".into(),
        },
    }
}

/// The kernel's transparent huge page mode (`always`, `madvise`, `never`), where it says one.
pub fn thp_mode() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    parse_thp_mode(&text)
}

/// The bracketed word of `/sys/kernel/mm/transparent_hugepage/enabled` (`always [madvise] never`).
pub fn parse_thp_mode(text: &str) -> Option<String> {
    let start = text.find('[')? + 1;
    let len = text[start..].find(']')?;
    Some(text[start..start + len].to_string())
}

/// A huge page's size on x86-64 and aarch64 Linux (4 KiB base pages).
const HUGE: usize = 2 << 20;

/// Zeroed anonymous memory, its start aligned to 2 MiB and advised for huge pages before
/// anything touches it (a page faulted in first stays 4 KiB until khugepaged gets to it).
pub struct HugeBuf {
    map: memmap2::MmapMut,
    start: usize,
    len: usize,
}

impl HugeBuf {
    pub fn zeroed(len: usize) -> io::Result<Self> {
        // one huge page more than asked, to start at a 2 MiB boundary; the slack is never
        // touched, so it never becomes resident
        let map = memmap2::MmapOptions::new()
            .len(len.saturating_add(HUGE).max(1))
            .map_anon()?;
        let start = map.as_ptr().align_offset(HUGE).min(HUGE);
        #[cfg(target_os = "linux")]
        map.advise(memmap2::Advice::HugePage)?;
        Ok(HugeBuf { map, start, len })
    }

    /// `len` bytes of `src` read into a new buffer.
    pub fn read_from(src: &mut impl Read, len: usize) -> io::Result<Self> {
        let mut buf = HugeBuf::zeroed(len)?;
        src.read_exact(&mut buf)?;
        Ok(buf)
    }

    /// The first `len` bytes of `file` read into a new buffer, in 64 MiB pieces on the rayon
    /// pool: each page's first touch (the kernel zeroing 2 MiB) and its copy from the page cache
    /// run on every core, which halves an 8B model's load on two.
    #[cfg(unix)]
    pub fn read_file(file: &std::fs::File, len: usize) -> io::Result<Self> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        const PIECE: usize = 64 << 20;
        let mut buf = HugeBuf::zeroed(len)?;
        buf.par_chunks_mut(PIECE)
            .enumerate()
            .try_for_each(|(i, piece)| file.read_exact_at(piece, (i * PIECE) as u64))?;
        Ok(buf)
    }

    #[cfg(not(unix))]
    pub fn read_file(file: &std::fs::File, len: usize) -> io::Result<Self> {
        Self::read_from(&mut &*file, len)
    }

    /// The bytes, read-only from now on, as an owner for `weights::Bytes`.
    pub fn freeze(self) -> io::Result<Frozen> {
        Ok(Frozen {
            map: self.map.make_read_only()?,
            start: self.start,
            len: self.len,
        })
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.start..self.start + self.len]
    }
}

/// A `HugeBuf` made read-only.
pub struct Frozen {
    map: memmap2::Mmap,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for Frozen {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl Frozen {
    /// How many of these bytes' mapping the kernel holds in huge pages now (`AnonHugePages`
    /// of its entry in `/proc/self/smaps`), where it reports it.
    pub fn huge_bytes(&self) -> Option<u64> {
        let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
        vma_huge_bytes(&text, self.map.as_ptr() as usize)
    }
}

/// `AnonHugePages` (in bytes) of the mapping of `smaps` that contains `addr`.
fn vma_huge_bytes(smaps: &str, addr: usize) -> Option<u64> {
    let mut inside = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = head.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(v) = line.strip_prefix("AnonHugePages:") {
                return v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .map(|k| k * 1024);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thp_mode_is_the_bracketed_word() {
        assert_eq!(
            parse_thp_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            parse_thp_mode("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(parse_thp_mode("always madvise never"), None);
    }

    #[test]
    fn huge_bytes_of_the_mapping_holding_an_address() {
        let t = "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\nSize: 4096 kB\nAnonHugePages:    2048 kB\n\
                 7f0000400000-7f0000401000 r--p 00000000 00:00 0\nAnonHugePages:       0 kB\n";
        assert_eq!(vma_huge_bytes(t, 0x7f0000123456), Some(2 << 20));
        assert_eq!(vma_huge_bytes(t, 0x7f0000400000), Some(0));
        assert_eq!(vma_huge_bytes(t, 0x10), None);
    }

    /// The buffer starts on a 2 MiB boundary, holds what was read, and reads back the same
    /// once frozen; a short source is an error, not a partly zero buffer.
    #[test]
    fn reads_into_an_aligned_buffer() {
        let src: Vec<u8> = (0..5_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let buf = HugeBuf::read_from(&mut &src[..], src.len()).expect("read");
        assert_eq!(buf.as_ptr() as usize % HUGE, 0);
        assert!(buf[..] == src[..]);
        let frozen = buf.freeze().expect("freeze");
        assert!(frozen.as_ref() == &src[..]);
        assert!(HugeBuf::read_from(&mut &src[..10], 11).is_err());
        assert!(HugeBuf::zeroed(0).expect("empty").is_empty());
    }

    /// A file read in pieces on the pool is the file, past a piece boundary and at an odd
    /// length; a file shorter than asked is an error.
    #[test]
    fn reads_a_file_in_pieces() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..(64usize << 20) + 12_345)
            .map(|i| (i % 253) as u8)
            .collect();
        std::fs::write(&path, &bytes).expect("write");
        let f = std::fs::File::open(&path).expect("open");
        let buf = HugeBuf::read_file(&f, bytes.len()).expect("read");
        assert!(buf[..] == bytes[..]);
        assert!(HugeBuf::read_file(&f, bytes.len() + 1).is_err());
    }

    /// On Linux with huge pages on (`madvise` or `always`: the kernel compacts memory for an
    /// advised region when it faults), a buffer read in is held in 2 MiB pages.
    #[test]
    fn a_read_buffer_is_in_huge_pages_where_they_are_on() {
        if !matches!(thp_mode().as_deref(), Some("always" | "madvise")) {
            // CI sets REQUIRE_HUGEPAGES (scripts/test.sh): there, a kernel without them fails
            assert!(
                std::env::var_os("REQUIRE_HUGEPAGES").is_none(),
                "transparent huge pages are {:?} here; unset REQUIRE_HUGEPAGES on such a machine",
                thp_mode()
            );
            eprintln!("transparent huge pages are off here: nothing to check");
            return;
        }
        let src = vec![3u8; 8 * HUGE];
        let buf = HugeBuf::read_from(&mut &src[..], src.len()).expect("read");
        let huge = buf.freeze().expect("freeze").huge_bytes();
        assert!(
            huge.is_some_and(|h| h >= 4 * HUGE as u64),
            "{huge:?} bytes in huge pages"
        );
    }
}
