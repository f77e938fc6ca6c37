//! Safetensors files (single or sharded), memory-mapped, as `mlx_lm` and `mx.save_safetensors`
//! write them: `"__metadata__"` may be `null` and the data section need not be aligned, so
//! tensors are byte ranges into the map and nothing assumes alignment.
//! Format: <https://github.com/huggingface/safetensors> (8-byte LE header length, JSON header).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use serde_json::Value;

use crate::engine::error::{EngineError, Result};
#[cfg(target_os = "linux")]
use crate::engine::resident::AlignedMap;
use crate::engine::resident::{self, Frozen, HugeBuf, Residency};

/// A cheaply clonable, immutable byte range of a memory map or of an owned buffer.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub fn from_vec(v: Vec<u8>) -> Self {
        let len = v.len();
        Bytes {
            owner: Arc::new(v),
            start: 0,
            len,
        }
    }
    /// Bytes `start..start + len` of `owner` (a map or buffer other ranges may share).
    pub(crate) fn slice_of(
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
        len: usize,
    ) -> Self {
        Bytes { owner, start, len }
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    F16,
    BF16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
}

impl Dtype {
    fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "U16" => Dtype::U16,
            "I16" => Dtype::I16,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "U32" => Dtype::U32,
            "I32" => Dtype::I32,
            "F32" => Dtype::F32,
            "U64" => Dtype::U64,
            "I64" => Dtype::I64,
            "F64" => Dtype::F64,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One tensor's description inside a file's header; offsets are relative to the data section.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

/// Parses a safetensors header (pure: no I/O). `file_len` is the whole file's length.
/// Returns the offset of the data section and the tensors.
pub fn parse_header(
    bytes: &[u8],
) -> std::result::Result<(usize, BTreeMap<String, TensorInfo>), String> {
    if bytes.len() < 8 {
        return Err(format!(
            "file is {} bytes long, shorter than the 8-byte header length",
            bytes.len()
        ));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&bytes[..8]);
    let hlen = u64::from_le_bytes(n);
    let data_start = 8u64
        .checked_add(hlen)
        .filter(|&e| e <= bytes.len() as u64)
        .ok_or_else(|| {
            format!(
                "header length {hlen} runs past the end of the file ({} bytes): truncated or not safetensors",
                bytes.len()
            )
        })? as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| format!("header is not a JSON object: {e}"))?;
    let data_len = bytes.len() - data_start;
    let mut tensors = BTreeMap::new();
    for (name, v) in header {
        if name == "__metadata__" {
            continue; // a map of strings, or null as mx.save_safetensors writes it
        }
        let obj = v
            .as_object()
            .ok_or_else(|| format!("tensor `{name}`: entry is not an object"))?;
        let dt = obj
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("tensor `{name}`: no `dtype`"))?;
        let dtype =
            Dtype::parse(dt).ok_or_else(|| format!("tensor `{name}`: unknown dtype `{dt}`"))?;
        let shape = obj
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| format!("tensor `{name}`: `shape` is not a list of sizes"))?;
        let offs = obj
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .filter(|a| a.len() == 2)
            .ok_or_else(|| format!("tensor `{name}`: `data_offsets` is not [begin, end]"))?;
        let (begin, end) = (offs[0], offs[1]);
        let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let want = numel.and_then(|n| n.checked_mul(dtype.size()));
        if end < begin || Some(end - begin) != want {
            return Err(format!(
                "tensor `{name}`: data_offsets [{begin}, {end}] hold {} bytes, but {dtype} {shape:?} needs {}",
                end.saturating_sub(begin),
                want.map_or("an impossible number of".to_string(), |w| w.to_string())
            ));
        }
        if end > data_len {
            return Err(format!(
                "tensor `{name}`: data ends at byte {end} of the data section, which has only {data_len} bytes: the file is truncated"
            ));
        }
        tensors.insert(
            name,
            TensorInfo {
                dtype,
                shape,
                begin,
                end,
            },
        );
    }
    // Two tensors sharing bytes is a corrupt (or crafted) file: writes to one would be reads
    // of the other, and the format forbids it.
    let mut spans: Vec<(&str, usize, usize)> = tensors
        .iter()
        .filter(|(_, t)| t.end > t.begin)
        .map(|(n, t)| (n.as_str(), t.begin, t.end))
        .collect();
    spans.sort_by_key(|&(_, b, e)| (b, e));
    for w in spans.windows(2) {
        if w[1].1 < w[0].2 {
            return Err(format!(
                "tensors `{}` and `{}` overlap (bytes [{}, {}) and [{}, {}) of the data section)",
                w[0].0, w[1].0, w[0].1, w[0].2, w[1].1, w[1].2
            ));
        }
    }
    Ok((data_start, tensors))
}

/// A tensor's bytes on the host with its dtype and shape.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub name: String,
    pub path: PathBuf,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Bytes,
}

impl HostTensor {
    fn err(&self, why: impl Into<String>) -> EngineError {
        EngineError::BadTensor {
            path: self.path.clone(),
            name: self.name.clone(),
            why: why.into(),
        }
    }

    /// Checks the shape against `want`, naming both in the error.
    pub fn expect_shape(&self, want: &[usize]) -> Result<()> {
        if self.shape != want {
            return Err(self.err(format!("expected shape {want:?}, found {:?}", self.shape)));
        }
        Ok(())
    }

    /// Float values widened to f32 (bf16 and f16 widen exactly).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let b = &self.bytes[..];
        Ok(match self.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F64 => b
                .chunks_exact(8)
                .map(|c| {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(c);
                    f64::from_le_bytes(a) as f32
                })
                .collect(),
            other => {
                return Err(self.err(format!(
                    "expected a float tensor (F32, BF16, F16), found {other}"
                )))
            }
        })
    }

    /// An f32 candle tensor of the same shape on `device`.
    pub fn to_candle_f32(&self, device: &candle_core::Device) -> Result<candle_core::Tensor> {
        let v = self.to_f32_vec()?;
        Ok(candle_core::Tensor::from_vec(
            v,
            self.shape.clone(),
            device,
        )?)
    }
}

/// What identifies the bytes of a file opened from disk: size, times and (Unix) device, inode
/// and change time from the open file (`fstat`), not from its path, so a file renamed over the
/// path while a model loads leaves the stamp of the one read; the path, canonical, names it.
/// What the CPU decode copies' cache is keyed by (`cpu::tilecache::key`). Metadata, not
/// content: off Unix (no inode) a file put over the path with the same size and time, or a
/// write in place within one tick of the file system's clock, keeps the stamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStamp {
    /// The path it was opened by, canonical.
    pub path: PathBuf,
    pub len: u64,
    /// Modification time, nanoseconds since the Unix epoch (0 before it).
    pub mtime_ns: u128,
    /// Device, inode, change time and its nanoseconds (Unix; zeros elsewhere).
    pub unix: [u64; 4],
}

impl FileStamp {
    /// The stamp of `file`, opened by `path`.
    pub fn of(file: &std::fs::File, path: &Path) -> std::io::Result<FileStamp> {
        let m = file.metadata()?;
        let mtime_ns = m
            .modified()?
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        #[cfg(unix)]
        let unix = {
            use std::os::unix::fs::MetadataExt;
            [m.dev(), m.ino(), m.ctime() as u64, m.ctime_nsec() as u64]
        };
        #[cfg(not(unix))]
        let unix = [0; 4];
        Ok(FileStamp {
            path: std::fs::canonicalize(path)?,
            len: m.len(),
            mtime_ns,
            unix,
        })
    }

    /// The stamp of the file at `path`, opened now (tests).
    #[cfg(test)]
    pub(crate) fn of_path(path: &Path) -> FileStamp {
        let file = std::fs::File::open(path).expect("open");
        FileStamp::of(&file, path).expect("stamp")
    }
}

/// One memory-mapped safetensors file.
pub struct SafetensorsFile {
    pub path: PathBuf,
    map: Arc<dyn AsRef<[u8]> + Send + Sync>,
    data_start: usize,
    pub tensors: BTreeMap<String, TensorInfo>,
    /// How the bytes are held, for `WeightStore::describe_memory`.
    held: Held,
    /// Opened from the file at `path` (not built in memory): the open file's stamp. `None`
    /// also where the stamp could not be taken (then nothing is cached by it).
    stamp: Option<FileStamp>,
}

/// Where a file's bytes are (`resident.rs`).
#[derive(Clone)]
enum Held {
    /// An owned buffer (tests, synthetic models).
    Buffer,
    /// The file mapped in place.
    Mapped,
    /// The file mapped in place in 2 MiB entries.
    #[cfg(target_os = "linux")]
    HugeMapped(Arc<AlignedMap>),
    /// Read (or built) into a buffer in 2 MiB pages.
    Copied(Arc<Frozen>),
}

/// A plain read-only map as an owner for `Bytes`.
pub(crate) struct Map(pub(crate) memmap2::Mmap);
impl AsRef<[u8]> for Map {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, Residency::Mapped)
    }

    /// The file mapped in place, or in huge pages (`resident.rs`): mapped in 2 MiB entries
    /// where the page cache allows, else read into a buffer of them.
    pub fn open_with(path: &Path, residency: Residency) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
        let stamp = FileStamp::of(&file, path).ok();
        if residency != Residency::Mapped {
            let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
            let len = usize::try_from(len).map_err(|_| EngineError::SafetensorsFormat {
                path: path.to_path_buf(),
                why: format!("{len} bytes do not fit this machine's address space"),
            })?;
            // a failure here only means "not kept": the copy or the plain map follow
            #[cfg(target_os = "linux")]
            {
                let map = match residency {
                    Residency::HugeCopied => AlignedMap::open(&file, len).ok().flatten(),
                    _ if len > 0 => AlignedMap::map(&file, len).ok(),
                    _ => None,
                };
                if let Some(map) = map {
                    let map = Arc::new(map);
                    let mut f = Self::from_owner(path, map.clone())?;
                    f.held = Held::HugeMapped(map);
                    f.stamp = stamp;
                    return Ok(f);
                }
            }
            if residency == Residency::HugeCopied && resident::room_for_copy(len) {
                match HugeBuf::read_file(&file, len).and_then(HugeBuf::freeze) {
                    Ok(buf) => {
                        let mut f = Self::from_frozen(path, buf)?;
                        f.stamp = stamp;
                        return Ok(f);
                    }
                    // no memory for the copy: the plain map runs, only slower
                    Err(e) if e.kind() == std::io::ErrorKind::OutOfMemory => {}
                    Err(e) => return Err(EngineError::io(path, e)),
                }
            }
        }
        // SAFETY: the map is read-only; a model file rewritten underneath a running process is
        // outside what any mmap-based loader (mlx, candle, llama.cpp) can guard against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let mut f = Self::from_owner(path, Arc::new(Map(map)))?;
        f.held = Held::Mapped;
        f.stamp = stamp;
        Ok(f)
    }

    /// A file built in a huge-page buffer (synthetic models).
    pub fn from_huge(path: &Path, buf: HugeBuf) -> Result<Self> {
        let buf = buf.freeze().map_err(|e| EngineError::io(path, e))?;
        Self::from_frozen(path, buf)
    }

    fn from_frozen(path: &Path, buf: Frozen) -> Result<Self> {
        let buf = Arc::new(buf);
        let mut f = Self::from_owner(path, buf.clone())?;
        f.held = Held::Copied(buf);
        Ok(f)
    }

    /// Parses an in-memory file (tests, synthetic models).
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::from_owner(path, Arc::new(bytes))
    }

    fn from_owner(path: &Path, map: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Result<Self> {
        let (data_start, tensors) =
            parse_header((*map).as_ref()).map_err(|why| EngineError::SafetensorsFormat {
                path: path.to_path_buf(),
                why,
            })?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            map,
            data_start,
            tensors,
            held: Held::Buffer,
            stamp: None,
        })
    }

    pub fn get(&self, name: &str) -> Option<HostTensor> {
        let info = self.tensors.get(name)?;
        Some(HostTensor {
            name: name.to_string(),
            path: self.path.clone(),
            dtype: info.dtype,
            shape: info.shape.clone(),
            bytes: Bytes::slice_of(
                self.map.clone(),
                self.data_start + info.begin,
                info.end - info.begin,
            ),
        })
    }
}

/// All tensors of a model directory: `model.safetensors.index.json` shards, else every
/// `model*.safetensors` (what `mlx_lm.utils.load_model` globs).
pub struct WeightStore {
    pub dir: PathBuf,
    files: Vec<SafetensorsFile>,
    index: BTreeMap<String, usize>,
}

impl WeightStore {
    /// `dir`'s files mapped in place.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        Self::open_dir_with(dir, Residency::Mapped)
    }

    /// `dir`'s files, mapped or read into huge pages (`Residency::for_device`).
    pub fn open_dir_with(dir: &Path, residency: Residency) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut names: Vec<PathBuf> = Vec::new();
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| EngineError::io(&index_path, e))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| EngineError::Config {
                path: index_path.clone(),
                field: "(whole file)".into(),
                why: format!("not valid JSON: {e}"),
            })?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| EngineError::Config {
                    path: index_path.clone(),
                    field: "weight_map".into(),
                    why: "expected an object of tensor name -> shard file".into(),
                })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect();
            // shards live in the model directory: a name that leads elsewhere is refused
            if let Some(bad) = shards.iter().find(|s| {
                s.is_empty()
                    || s.contains(['/', '\\'])
                    || s.starts_with('.')
                    || s.chars().any(char::is_control)
                    || !s.ends_with(".safetensors")
            }) {
                return Err(EngineError::Config {
                    path: index_path.clone(),
                    field: "weight_map".into(),
                    why: format!(
                        "shard {bad:?} is not a plain *.safetensors file name in the model directory"
                    ),
                });
            }
            shards.sort();
            shards.dedup();
            names = shards.into_iter().map(|s| dir.join(s)).collect();
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| EngineError::io(dir, e))?;
            for e in rd {
                let e = e.map_err(|e| EngineError::io(dir, e))?;
                let n = e.file_name().to_string_lossy().to_string();
                if n.starts_with("model") && n.ends_with(".safetensors") {
                    names.push(e.path());
                }
            }
            names.sort();
        }
        if names.is_empty() {
            return Err(EngineError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for p in names {
            let f = SafetensorsFile::open_with(&p, residency)?;
            for k in f.tensors.keys() {
                index.insert(k.clone(), files.len());
            }
            files.push(f);
        }
        Ok(WeightStore {
            dir: dir.to_path_buf(),
            files,
            index,
        })
    }

    /// The stamps of the files the tensors come from, where every one was read from disk
    /// (`None` for a store built in memory, whose paths say nothing of its bytes).
    pub fn file_stamps(&self) -> Option<Vec<&FileStamp>> {
        if self.files.is_empty() {
            return None;
        }
        self.files.iter().map(|f| f.stamp.as_ref()).collect()
    }

    /// A store over already-parsed files (synthetic models, tests).
    pub fn from_files(dir: &Path, files: Vec<SafetensorsFile>) -> Self {
        let mut index = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for k in f.tensors.keys() {
                index.insert(k.clone(), i);
            }
        }
        WeightStore {
            dir: dir.to_path_buf(),
            files,
            index,
        }
    }

    pub fn get(&self, name: &str) -> Option<HostTensor> {
        self.index.get(name).and_then(|&i| self.files[i].get(name))
    }

    /// Every tensor name, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.index.keys().map(String::as_str)
    }

    /// How the files' bytes are held now, in words (`bot bench`'s "weights memory"): mapped
    /// in place, and how much of them the kernel maps or holds in 2 MiB pages.
    pub fn describe_memory(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        // (huge bytes, all bytes) of the files held each way
        let (mut mapped, mut huge_mapped, mut copied, mut buffers) = (0u64, (0, 0), (0, 0), 0u64);
        for f in &self.files {
            let len = (*f.map).as_ref().len() as u64;
            match &f.held {
                Held::Buffer => buffers += len,
                Held::Mapped => mapped += len,
                #[cfg(target_os = "linux")]
                Held::HugeMapped(m) => {
                    huge_mapped.0 += m.huge_bytes().unwrap_or(0).min(len);
                    huge_mapped.1 += len;
                }
                Held::Copied(c) => {
                    // the buffer has a huge page of slack for alignment, never touched
                    copied.0 += c.huge_bytes().unwrap_or(0).min(len);
                    copied.1 += len;
                }
            }
        }
        let mut parts = Vec::new();
        if mapped > 0 {
            parts.push(format!("{:.1} MiB mapped in place", mib(mapped)));
        }
        if huge_mapped.1 > 0 {
            parts.push(format!(
                "mapped in place: {:.1} of {:.1} MiB in 2 MiB pages",
                mib(huge_mapped.0),
                mib(huge_mapped.1)
            ));
        }
        if copied.1 > 0 {
            parts.push(format!(
                "read into memory: {:.1} of {:.1} MiB in 2 MiB pages",
                mib(copied.0),
                mib(copied.1)
            ));
        }
        if buffers > 0 {
            parts.push(format!("{:.1} MiB in memory", mib(buffers)));
        }
        parts.join("; ")
    }

    pub fn require(&self, name: &str) -> Result<HostTensor> {
        self.get(name).ok_or_else(|| EngineError::MissingTensor {
            dir: self.dir.clone(),
            name: name.to_string(),
            hint: format!("{} tensors present", self.index.len()),
        })
    }
}

/// Where each tensor of a safetensors file goes: `plan_safetensors` returns the header bytes
/// and each tensor's absolute byte range, so a writer can fill one buffer in place.
pub struct FilePlan {
    pub bytes_total: usize,
    pub header: Vec<u8>,
    pub ranges: Vec<std::ops::Range<usize>>,
}

pub fn plan_safetensors(tensors: &[(String, Dtype, Vec<usize>)]) -> FilePlan {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "mlx"}));
    let mut off = 0usize;
    let mut rel = Vec::new();
    for (name, dt, shape) in tensors {
        let n = shape.iter().product::<usize>() * dt.size();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dt.to_string().to_uppercase(), "shape": shape, "data_offsets": [off, off + n]}),
        );
        rel.push(off..off + n);
        off += n;
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap_or_default();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' '); // align the data section, as the safetensors crate does
    }
    let mut full = (h.len() as u64).to_le_bytes().to_vec();
    full.extend_from_slice(&h);
    let start = full.len();
    FilePlan {
        bytes_total: start + off,
        ranges: rel
            .into_iter()
            .map(|r| r.start + start..r.end + start)
            .collect(),
        header: full,
    }
}

#[cfg(test)]
mod tests {
    /// #18.12: two tensors sharing bytes were accepted.
    #[test]
    fn overlapping_tensors_are_refused() {
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let e = parse_header(&{
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend(h.as_bytes());
            b.extend([0u8; 12]);
            b
        })
        .unwrap_err();
        assert!(e.contains("`a` and `b` overlap"), "{e}");
    }

    use super::*;

    fn file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(data);
        v
    }

    /// A store keeps each file's stamp as it opened it: a file renamed over the path later (a
    /// model updated during a load) does not lend its stamp to the bytes mapped; a file built
    /// in memory has none.
    #[test]
    fn stamps_are_the_opened_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("model.safetensors");
        let h = r#"{"a":{"dtype":"U32","shape":[2],"data_offsets":[0,8]}}"#;
        let bytes = file(h, &[1, 0, 0, 0, 2, 0, 0, 0]);
        std::fs::write(&p, &bytes).expect("write");
        let store =
            WeightStore::from_files(dir.path(), vec![SafetensorsFile::open(&p).expect("open")]);
        let opened = store.file_stamps().expect("from disk")[0].clone();
        assert_eq!(opened, FileStamp::of_path(&p));
        assert_eq!(opened.len, bytes.len() as u64);
        let held = std::fs::File::open(&p).expect("open");
        let other = dir.path().join("other");
        std::fs::write(&other, &bytes).expect("write");
        std::fs::rename(&other, &p).expect("rename");
        assert_eq!(store.file_stamps().expect("from disk")[0], &opened);
        // the stamp comes from the open file, not from what the path names now
        #[cfg(unix)]
        {
            let again = FileStamp::of(&held, &p).expect("stamp");
            assert_eq!(again.unix[1], opened.unix[1], "the opened file's inode");
            assert_ne!(
                FileStamp::of_path(&p).unix[1],
                opened.unix[1],
                "another inode at the path"
            );
        }
        drop(held);
        let built = WeightStore::from_files(
            dir.path(),
            vec![SafetensorsFile::from_bytes(&p, bytes).expect("parse")],
        );
        assert!(built.file_stamps().is_none());
    }

    #[test]
    fn parses_null_metadata_and_unaligned_header() {
        // header length 61: data starts at an odd offset
        let h = r#"{"__metadata__":null,"a":{"dtype":"U32","shape":[2],"data_offsets":[0,8]}}"#;
        let b = file(h, &[1, 0, 0, 0, 2, 0, 0, 0]);
        let (start, t) = parse_header(&b).unwrap();
        assert_eq!(start, 8 + h.len());
        assert_eq!(t["a"].shape, vec![2]);
    }

    #[test]
    fn rejects_truncation_and_bad_dtypes() {
        let h = r#"{"a":{"dtype":"U32","shape":[4],"data_offsets":[0,16]}}"#;
        let e = parse_header(&file(h, &[0; 8])).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        let h = r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#;
        assert!(parse_header(&file(h, &[0]))
            .unwrap_err()
            .contains("unknown dtype `Q9`"));
        let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(parse_header(&file(h, &[0; 8]))
            .unwrap_err()
            .contains("needs 12"));
        let mut b = file("{}", &[]);
        b[0] = 200;
        assert!(parse_header(&b).unwrap_err().contains("past the end"));
    }
}
