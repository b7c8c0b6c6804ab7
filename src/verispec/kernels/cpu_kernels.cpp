// Small-batch CPU kernels for decoding: weight-streaming matrix products and cached attention.
//
// y[m, n] = x[m, k] . W[n, k]^T for the few rows of a decoding step or a verification pass.
// A block of output columns is read from memory once and used for every row, so a pass
// over m positions costs about what one position costs while memory is the limit.
//
// Batch invariance: every output value is accumulated in the same order whatever m is and
// whatever tile it falls in, so row i of an m-row pass is bit-identical to a 1-row pass
// over that row. A verification pass therefore computes exactly the logits that plain
// decoding would, and greedy speculative output cannot drift from the baseline.
//
// Built with -ffp-contract=off: every fused multiply-add below is written out, so the
// compiler cannot fuse differently in different template instances.
//
// Every format also has a "panel" layout (16 output columns interleaved) that each thread
// reads as one sequential stream, fetched stream_prefetch() bytes ahead: the row-major
// kernels read several short streams at once and fell behind the memory system.
// `linear_float_panels` keeps float32 activations; `linear_int8_panels` carries them in
// 16-bit fixed point and multiplies 16-bit pairs (`vpdpwssd`).
//
// int4 (`linear_int4_panels`): the activations are rounded to int8 per row in groups of 32
// and multiplied with 8-bit integer dot products, as llama.cpp does. Dequantising to
// float32 costs 4 FMAs per 64 weights and row, which made one-row int4 decoding
// compute-bound on this class of machine and each extra row of a verification pass nearly
// as dear as the first; `vpdpbusd` does 64 products in one instruction. The rounding
// changes the numerics (the product of the int4 weights with the rounded activations), not
// batch invariance: rows are rounded one by one.
//
// The panel kernels are written once over "16 lanes" (one AVX-512 register, or two AVX2
// registers) and give the same bits with either instruction set; the row-major kernels
// (`linear_float`, `linear_int8`, `linear_int4`) remain for what the panels do not cover.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace {

// ------------------------------------------------------------------ threads

// The start of each region of a product to come, as for_each_region_piece splits it:
// `regions` regions of `count` panels of `stride` bytes, read as two streams each.
struct RegionStart {
  const uint8_t* panels;
  int64_t count, stride, regions, bytes;  // bytes: how much of each stream to read
};
void read_region_start(const RegionStart& start, int64_t region);

// A parallel loop that tolerates a busy machine. OpenMP's fork-join waits at every
// barrier for each thread to arrive, so when another process holds a core, each of the
// hundreds of parallel regions in a decoding step waits out a scheduler time slice (a step
// of 15 ms took 500 ms on a loaded 2-core machine). Here the calling thread takes chunks
// of work from a shared counter and helpers join in when they are awake: the loop ends
// when every chunk is done, never waiting for a helper that has not started.
class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool pool;
    return pool;
  }

  // Has each awake helper read the start of its region of a product to come (helper i,
  // region i) into its cache, and returns at once. The helpers and the memory are idle while
  // the calling thread does a layer's serial work (a norm, SwiGLU); a helper still reading
  // when run() comes joins that run late, which run() allows for.
  void read_ahead(const RegionStart& start) {
    if (helpers_.empty() || sleeping_.load(std::memory_order_relaxed)) return;  // waking costs more
    const uint64_t seq = errand_.load(std::memory_order_relaxed) + 1;
    errands_[seq & 1] = start;
    errand_.store(seq, std::memory_order_release);
  }

  // how many threads a call to run() can use
  int64_t threads() const { return std::min<int64_t>(at::get_num_threads(), 1 + helpers_.size()); }

  // body(chunk) for chunk in [0, chunks), on up to threads() threads
  void run(int64_t chunks, const std::function<void(int64_t)>& body) {
    const int64_t threads = this->threads();
    if (chunks <= 1 || threads <= 1 || busy_.exchange(true)) {  // nested or serial: inline
      for (int64_t i = 0; i < chunks; ++i) body(i);
      return;
    }
    const uint64_t gen = ((ticket_.load() >> 48) + 1) & 0xFFFF;
    slots_[gen & 1] = &body;
    done_.store(0);
    helpers_wanted_.store(threads - 1);
    ticket_.store(gen << 48 | static_cast<uint64_t>(chunks) << 24);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins > 2000) sched_yield();  // a helper was preempted mid-chunk: let it run
      else _mm_pause();
    }
    busy_.store(false);
  }

 private:
  WorkPool() {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 1; i < cores; ++i) helpers_.emplace_back([this, i] { helper(i); });
    for (auto& t : helpers_) t.detach();
  }

  // claims chunks of generation gen until none is left; true if it did any
  bool work(uint64_t gen) {
    bool worked = false;
    for (;;) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      const uint64_t index = t & 0xFFFFFF, total = (t >> 24) & 0xFFFFFF;
      if ((t >> 48) != gen || index >= total) return worked;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      (*slots_[gen & 1])(static_cast<int64_t>(index));
      done_.fetch_add(1, std::memory_order_release);
      worked = true;
    }
  }

  void helper(unsigned id) {
    uint64_t seen = 0, errand_seen = 0;
    for (;;) {
      for (int spins = 0;; ++spins) {  // spin briefly: the next call usually follows within microseconds
        const uint64_t gen = ticket_.load(std::memory_order_acquire) >> 48;
        if (gen != seen) {
          seen = gen;
          if (id <= helpers_wanted_.load()) work(gen);
          spins = 0;
          continue;
        }
        const uint64_t errand = errand_.load(std::memory_order_acquire);
        if (errand != errand_seen) {
          errand_seen = errand;
          if (id < errands_[errand & 1].regions) read_region_start(errands_[errand & 1], id);
          spins = 0;
          continue;
        }
        if (spins > 20000) break;
        _mm_pause();
      }
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.fetch_add(1);
      wake_.wait_for(lock, std::chrono::milliseconds(50),
                     [&] { return (ticket_.load() >> 48) != seen; });
      sleeping_.fetch_sub(1);
    }
  }

  std::vector<std::thread> helpers_;
  std::atomic<uint64_t> ticket_{0};  // generation (16 bits) | chunks (24) | next chunk (24)
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> helpers_wanted_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> busy_{false};
  const std::function<void(int64_t)>* slots_[2] = {nullptr, nullptr};
  std::atomic<uint64_t> errand_{0};  // how many read_ahead() calls so far
  RegionStart errands_[2] = {};
  std::mutex mutex_;
  std::condition_variable wake_;
};

// for (i in [0, n)) in about `chunks_per_thread` pieces per thread, none under `grain` items
inline void parallel_range(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t threads = at::get_num_threads();
  int64_t chunks = std::min<int64_t>(threads * 8, (n + grain - 1) / std::max<int64_t>(grain, 1));
  chunks = std::max<int64_t>(chunks, 1);
  if (chunks == 1 || threads == 1) {
    body(0, n);
    return;
  }
  const int64_t size = (n + chunks - 1) / chunks;
  WorkPool::instance().run((n + size - 1) / size, [&](int64_t c) {
    body(c * size, std::min(n, (c + 1) * size));
  });
}

// Sets a fetch distance from Python: whole cache lines, 0 for none.
void store_distance(std::atomic<int64_t>& distance, int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes % 64 == 0, "the prefetch distance must be a multiple of 64 bytes, not ", bytes);
  distance.store(bytes, std::memory_order_relaxed);
}

// How far ahead a sequential stream of weights is fetched into the cache, 20 KB unless
// `set_stream_prefetch` changes it (0: none, the hardware prefetcher alone). Without it the
// int8 and int4 panels read a tenth less than with it; `benchmarks/weight_streams.py
// --prefetch` compares distances.
std::atomic<int64_t> g_stream_prefetch{20 * 1024};
inline int64_t stream_prefetch() { return g_stream_prefetch.load(std::memory_order_relaxed); }
void set_stream_prefetch(int64_t bytes) { store_distance(g_stream_prefetch, bytes); }

// An Intel processor: its cores fetch their weights, and attention its cache, in software.
bool is_intel() {
  __builtin_cpu_init();  // this runs among the static initialisers
  return __builtin_cpu_is("intel");
}

// An AMD family 19h core with AVX-512: the Zen 4 (the Zen 3 is family 19h without it).
bool is_zen4() {
  __builtin_cpu_init();  // this runs among the static initialisers
  return __builtin_cpu_is("amdfam19h") && __builtin_cpu_supports("avx512f");
}

// An AMD family 19h core without AVX-512: the Zen 3.
bool is_zen3() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amdfam19h") && !__builtin_cpu_supports("avx512f");
}

// How far ahead passes of several rows that read one stream per thread (more rows than the
// format reads as pairs) fetch it, unless `set_pass_stream_prefetch` changes it: on the Zen 4
// 4 KB, on the Zen 3 2 KB, elsewhere as far as stream_prefetch(). Such a tile takes rows times
// as long over each line as a one-row step, so a shorter distance covers the same time: on the
// Zen 4, with 4 KB in place, 20 KB took int4 passes over 9 / 17 positions 1.03-1.04x / 1.01x
// the time, int8 over 9 1.02-1.03x, bfloat16 over 9 1.08-1.11x (benchmarks/stack_ab.py with
// variants/pass_streams_fetched_20_kb_ahead.patch; NOTES.md, "The Zen 4 a fourth time"). On
// the Zen 3, 2 KB against 20 KB took int4 passes over 5 / 9 positions 0.90-0.99x / 0.87-0.94x
// the time, int8 over 5 0.91-1.00x, bfloat16 over 5 0.97x (benchmarks/pair_prefetch.py
// --positions 5 / 9 compares distances; NOTES.md, "The Zen 3 again").
int64_t default_pass_stream_prefetch() {
  if (is_zen4()) return 4 * 1024;
  return is_zen3() ? 2 * 1024 : stream_prefetch();
}
std::atomic<int64_t> g_pass_stream_prefetch{default_pass_stream_prefetch()};
inline int64_t pass_stream_prefetch() { return g_pass_stream_prefetch.load(std::memory_order_relaxed); }
void set_pass_stream_prefetch(int64_t bytes) { store_distance(g_pass_stream_prefetch, bytes); }

// How far ahead each of a one-row product's two streams per thread is fetched in software,
// unless `set_pair_prefetch` changes it: on Intel processors 1.5 KB, on the Zen 3 1 KB,
// elsewhere 0 (the hardware prefetcher alone). On the Intel Xeon these kernels were measured
// on, 1.5 KB ahead took the 1.5B's one-row steps from 37.1 to 33.5 ms in int4 and from 122 to
// 99 ms in bfloat16, near the best distance in every format; on an AMD EPYC (Zen 4), fetching
// two streams in software read less than the hardware alone, and on the Zen 5 it gained
// nothing consistent. On the Zen 3, 1 KB ahead took int4 steps to 0.90-0.94x the time of the
// hardware alone, bfloat16 0.85-1.01x, int8 0.91-1.03x, float32 0.99-1.02x in four runs
// (benchmarks/pair_prefetch.py compares distances; NOTES.md, "The Zen 3 a fifth time").
int64_t default_pair_prefetch() {
  if (is_intel()) return 1536;
  return is_zen3() ? 1024 : 0;
}
std::atomic<int64_t> g_pair_prefetch{default_pair_prefetch()};
inline int64_t pair_prefetch() { return g_pair_prefetch.load(std::memory_order_relaxed); }
void set_pair_prefetch(int64_t bytes) { store_distance(g_pair_prefetch, bytes); }

// How far ahead attention fetches its cached keys in software, and whether it fetches its
// values a tile ahead, unless `set_attention_prefetch` changes it: on Intel processors 1.5 KB,
// elsewhere 0 (the hardware prefetcher alone), measured as attention (benchmarks/attention.py),
// apart from how far the products fetch their weights.
int64_t default_attention_prefetch() {
  return is_intel() ? 1536 : 0;
}
std::atomic<int64_t> g_attention_prefetch{default_attention_prefetch()};
inline int64_t attention_prefetch() { return g_attention_prefetch.load(std::memory_order_relaxed); }
void set_attention_prefetch(int64_t bytes) { store_distance(g_attention_prefetch, bytes); }

// How far ahead each of the two streams per thread of a product that reads pairs of panels
// is also fetched into L2, where it is fetched in software at all, unless
// `set_pair_l2_prefetch` changes it: on Intel processors 3 KB, elsewhere 0 (not at all; no
// further than the fetch into L1: not either). A core keeps only so many lines in flight into
// L1; fetched into L2 further ahead, more of them are on their way. On the Xeon without AMX,
// without it one-row steps took 1.03-1.05x (int4, int8), 1.06x (bfloat16) and 1.10x
// (float32) the time, 2 and 4 KB within 0-6% of 3 KB (benchmarks/pair_prefetch.py --knob
// pair-l2), and passes over 5 positions 1.02x (int4), 1.01x (int8), 1.07x (bfloat16) and
// 1.08x (float32) (benchmarks/stack_ab.py --positions 5 --patch
// variants/l2_fetch_only_in_one_row_products.patch; NOTES.md, "The Xeon without AMX a fifth
// time"); over 9 positions int4 1.03x (its pairs read in blocks), bfloat16 1.05x, int8 and
// float32 within 1%. Integer passes of 5 to 8 rows in one tile take pass_pair_l2_prefetch().
int64_t default_pair_l2_prefetch() {
  return is_intel() ? 3072 : 0;
}
std::atomic<int64_t> g_pair_l2_prefetch{default_pair_l2_prefetch()};
inline int64_t pair_l2_prefetch() { return g_pair_l2_prefetch.load(std::memory_order_relaxed); }
void set_pair_l2_prefetch(int64_t bytes) { store_distance(g_pair_l2_prefetch, bytes); }

// How far ahead passes of kPassPairRows rows or more (16-bit float panels: 3), where they
// read pairs, fetch each stream in software, unless `set_pass_pair_prefetch` changes it: on
// Intel processors as far as one-row products, elsewhere 1 KB. Such a tile spends several
// times as long on each line as a one-row product, and the hardware prefetcher alone fell
// behind it: on the Zen 4, 1 KB ahead took int4 steps over 5 / 6 positions to 0.89-0.98x /
// 0.83-0.87x the time, int8 over 5 to 0.88-0.93x; over 2 to 4 positions int4 took
// 1.01-1.09x and int8 over 3 0.99x, so fewer rows keep to the hardware (benchmarks/stack_ab.py;
// the patch variants/pass_pairs_fetched_by_hardware.patch undoes it; NOTES.md, "The Zen 4 a
// third time that day"). A bfloat16 line holds twice a float32 line's inputs, and its
// passes over 3 positions took 0.86-0.93x the time fetched 512 B or 1 KB ahead, float32's
// 1.02-1.06x (benchmarks/pair_prefetch.py --positions 3; NOTES.md, "The Zen 4 a fourth
// time"); float16 panels, which convert as much per line, follow bfloat16 unmeasured.
constexpr int64_t kPassPairRows = 5;
int64_t default_pass_pair_prefetch() {
  return is_intel() ? default_pair_prefetch() : 1024;
}
std::atomic<int64_t> g_pass_pair_prefetch{default_pass_pair_prefetch()};
inline int64_t pass_pair_prefetch() { return g_pass_pair_prefetch.load(std::memory_order_relaxed); }
void set_pass_pair_prefetch(int64_t bytes) { store_distance(g_pass_pair_prefetch, bytes); }
// How far ahead integer passes of kPassPairRows rows or more that read pairs in one tile (5 to
// kPairRows rows) also fetch each stream into L2, unless `set_pass_pair_l2_prefetch` changes
// it: on processors with AMX 0 (not at all), on the Zen 4 3 KB, elsewhere as far as one-row
// products, whatever `set_pair_l2_prefetch` makes that (-1 below). On the Xeon with AMX, int8 passes over 5
// positions took 0.963x the time without it (three runs: 0.963-0.966x), int4's
// 0.984-0.989x, while passes over 3 positions took 1.017x (int8) and 1.003x (int4), so those
// keep it; on the Xeon without AMX passes over 5 positions took 1.01x (int8) and 1.02x (int4)
// without it (benchmarks/stack_ab.py --patch
// variants/l2_fetch_only_in_one_row_products.patch; NOTES.md, "The Xeon with AMX a
// fourteenth time"). What differs between the two is not known; AMX is only what tells them
// apart, where a virtual machine's model number does not. On the Zen 4, whose one-row
// products fetch nothing into L2, 3 KB: without it int4 passes over 5 / 6 positions took
// 1.07x / 1.04x the time, int8's 1.02-1.10x / 1.04x, over 7 and 8 positions 0.97-1.04x
// (benchmarks/pair_prefetch.py --knob pass-pair-l2 --positions M; NOTES.md, "The Zen 4 a
// seventh time").
int64_t default_pass_pair_l2_prefetch() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("amx-tile")) return 0;
  return is_zen4() ? 3072 : -1;
}
std::atomic<int64_t> g_pass_pair_l2_prefetch{default_pass_pair_l2_prefetch()};
inline int64_t pass_pair_l2_prefetch() {
  const int64_t bytes = g_pass_pair_l2_prefetch.load(std::memory_order_relaxed);
  return bytes < 0 ? pair_l2_prefetch() : bytes;
}
void set_pass_pair_l2_prefetch(int64_t bytes) { store_distance(g_pass_pair_l2_prefetch, bytes); }

// how far ahead a product of `rows` rows that reads pairs fetches each stream, where passes
// of `pass_rows` rows or more fetch as passes
inline int64_t pair_prefetch_for(int64_t rows, int64_t pass_rows) {
  return rows >= pass_rows ? pass_pair_prefetch() : pair_prefetch();
}
// how far ahead into L2 an integer pair tile of `rows` rows fetches each stream
inline int64_t integer_pair_l2_prefetch_for(int64_t rows) {
  return rows >= kPassPairRows ? pass_pair_l2_prefetch() : pair_l2_prefetch();
}

// The helpers that only prefetch are always inlined: GCC counts a prefetch as no side effect,
// so a call it leaves out of line looks like a call that does nothing, and it drops it (with
// the branch it sits in, as it did to every pair's fetch once fetch_pair_ahead grew too large
// to inline by itself).
#define VERISPEC_PREFETCHES inline __attribute__((always_inline))

// Fetches `lines` cache lines from p + ahead on (a prefetch never faults, even past the end).
VERISPEC_PREFETCHES void fetch_ahead(const uint8_t* p, int64_t ahead, int lines) {
  for (int line = 0; line < lines; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64 * line), _MM_HINT_T0);
}

// fetch_ahead for one of a pair's streams: the lines `ahead` bytes on into L1 and, where `far`
// (pair_l2_prefetch()) lies beyond that, the lines `far` bytes on into L2
VERISPEC_PREFETCHES void fetch_pair_ahead(const uint8_t* p, int64_t ahead, int64_t far, int lines) {
  fetch_ahead(p, ahead, lines);
  if (far > ahead)
    for (int line = 0; line < lines; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + far + 64 * line), _MM_HINT_T1);
}

// Fetches lines [from, to) of a stream that ends at `end` (nothing past it).
VERISPEC_PREFETCHES void prefetch_lines(const uint8_t* from, const uint8_t* to, const uint8_t* end) {
  for (const uint8_t* p = from; p < std::min(to, end); p += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// fetch_ahead for `bytes` of rows of any type (a cache's keys or values), in whole lines
template <class T>
VERISPEC_PREFETCHES void fetch_rows(const T* p, int64_t bytes, int64_t ahead) {
  fetch_ahead(reinterpret_cast<const uint8_t*>(p), ahead, static_cast<int>((bytes + 63) / 64));
}

constexpr int kPanel = 16;  // output columns per panel, in every panel layout
constexpr int kGroup = 32;  // inputs per group: int4's scales, int8's and int4's rounded activations

// fn(std::integral_constant<int, R>{}) for R = rows in [1, Max]: a panel tile's row count
// is a template argument (each size keeps its own register allocation), chosen here at run time
template <int Max, class Fn, int... R>
inline void with_rows(int rows, const Fn& fn, std::integer_sequence<int, R...>) {
  (void)((rows == R + 1 ? (fn(std::integral_constant<int, R + 1>{}), true) : false) || ...);
}
template <int Max, class Fn>
inline void with_rows(int rows, const Fn& fn) {
  with_rows<Max>(rows, fn, std::make_integer_sequence<int, Max>{});
}

// How many streams each thread reads side by side in a one-row product: 2 unless
// `set_panel_streams` changes it. One core's hardware prefetcher keeps more of memory in
// flight for two sequential streams than for one: on this class of machine one core read
// int8 panels at 32.5 GB/s as one stream and 34.0 as two, int4 at 33.7 and 37.3
// (`benchmarks/weight_streams.py --threads 1 --rows 1 --streams 1 2` compares them).
std::atomic<int> g_panel_streams{2};
inline int panel_streams() { return g_panel_streams.load(std::memory_order_relaxed); }
void set_panel_streams(int64_t streams) {
  TORCH_CHECK(streams == 1 || streams == 2, "1 or 2 streams per thread, not ", streams);
  g_panel_streams.store(static_cast<int>(streams), std::memory_order_relaxed);
}

// A one-row product reads one region of the panels per thread. Each thread takes pieces of
// about 64 KB from the front of its own region, so that its reads stay unbroken streams,
// and then, once its own is done, pieces from the back of the others', so that theirs do too;
// near a region's end the pieces shrink to a quarter of what is left (down to a quarter
// piece). (Pieces taken in turn from a shared counter restarted the streams at every piece;
// each start costs the memory's latency before the prefetcher is ahead again. Pieces taken
// from the front of another's region broke its stream: smaller pieces taken that way made
// the 0.5B's one-row int4 steps 1.02x as long, from the back 0.99x, on the Xeon without
// AMX; NOTES.md, "The Xeon without AMX a sixth time".) Products under 128 KB per thread use
// fewer threads.
// panels to a piece of about 64 KB
inline int64_t region_grain(int64_t stride) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, stride)); }
// how many regions (one per thread) a product of `count` panels of `stride` bytes is read in
inline int64_t region_count(int64_t count, int64_t stride) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count / (2 * region_grain(stride))));
}

// where region r of `regions` starts, in panels (region r is [region_start(r), region_start(r + 1)))
inline int64_t region_start(int64_t count, int64_t regions, int64_t r) { return count * r / regions; }
// how many panels of region [lo, hi) its first stream reads when read as a pair (the second: the rest)
inline int64_t pair_half(int64_t lo, int64_t hi) { return (hi - lo + 1) / 2; }

// body(task, lo, hi, begin, end): units [begin, end) of region [lo, hi), which has
// units(lo, hi), for task `task` (one per thread, in [0, threads))
template <class Units, class Body>
void for_each_region_piece(int64_t count, int64_t stride, int64_t unit_panels, const Units& units, const Body& body) {
  const int64_t threads = region_count(count, stride);
  const int64_t piece = std::max<int64_t>(1, region_grain(stride) / unit_panels), least = std::max<int64_t>(1, piece / 4);
  // the units [front, back) of a region not yet taken (fewer than 2^32), in one word: front in the high half
  struct alignas(64) Span { std::atomic<uint64_t> word{0}; };
  std::vector<Span> spans(threads);
  for (int64_t r = 0; r < threads; ++r)
    spans[r].word.store(static_cast<uint64_t>(units(region_start(count, threads, r),
                                                    region_start(count, threads, r + 1))));
  WorkPool::instance().run(threads, [&](int64_t first) {
    for (int64_t visited = 0, r = first; visited < threads; ++visited, r = (r + 1) % threads) {
      const int64_t lo = region_start(count, threads, r), hi = region_start(count, threads, r + 1);
      const bool own = visited == 0;
      for (uint64_t word = spans[r].word.load(std::memory_order_relaxed);;) {
        const int64_t front = static_cast<int64_t>(word >> 32), back = static_cast<int64_t>(word & 0xFFFFFFFFu);
        if (front >= back) break;
        const int64_t take = std::min(back - front, std::min(piece, std::max(least, (back - front) / 4)));
        const uint64_t taken = own ? word + (static_cast<uint64_t>(take) << 32) : word - static_cast<uint64_t>(take);
        if (!spans[r].word.compare_exchange_weak(word, taken, std::memory_order_relaxed)) continue;
        body(first, lo, hi, own ? front : back - take, own ? front + take : back);
        word = spans[r].word.load(std::memory_order_relaxed);
      }
    }
  });
}

// How much of the start of each of its two streams a helper reads, for the product the
// calling thread is about to run, while that thread does a layer's serial work
// (WorkPool::read_ahead), unless `set_helper_prefetch` changes it; 0: nothing. On the Xeon
// without AMX, 32 KB and the pieces taken from the back above took the 0.5B's one-row int4
// steps to 0.98x the time (64 and 128 KB: 0.99x), the 1.5B's int8 steps 0.98x, its int4
// steps 0.99x. The size alone, against 32 KB over 40 rounds: none 1.026x the 0.5B's step time,
// 64 KB 0.998x, 128 KB 1.013x; on the 1.5B, over 24, none 0.994x (int4) and 1.003x (int8)
// (benchmarks/pair_prefetch.py --knob helper compares sizes; benchmarks/stack_ab.py --patch
// variants/pieces_from_the_front_and_no_helper_reads.patch undoes both; NOTES.md, "The Xeon
// without AMX a sixth time" and "a seventh time").
std::atomic<int64_t> g_helper_prefetch{32 * 1024};
inline int64_t helper_prefetch() { return g_helper_prefetch.load(std::memory_order_relaxed); }
void set_helper_prefetch(int64_t bytes) { store_distance(g_helper_prefetch, bytes); }

// Reads a byte of every line of the first start.bytes of region `region`'s two streams (as
// for_each_panel_pair splits it), side by side. Loads, not prefetches: as software
// prefetches into L2 the same reads took 0.99-1.00x the time, as loads 0.99x.
void read_region_start(const RegionStart& start, int64_t region) {
  const int64_t lo = region_start(start.count, start.regions, region);
  const int64_t hi = region_start(start.count, start.regions, region + 1);
  const int64_t half = pair_half(lo, hi), bytes = std::min(start.bytes, half * start.stride);
  const volatile uint8_t *first = start.panels + lo * start.stride, *second = start.panels + (lo + half) * start.stride;
  const bool pair = lo + half < hi;
  uint8_t sink = 0;
  for (int64_t at = 0; at < bytes; at += 64) sink ^= first[at] ^ (pair ? second[at] : 0);
  static std::atomic<uint8_t> g_sink;  // so that the loads are kept
  g_sink.store(sink, std::memory_order_relaxed);
}

// Products of up to this many rows read their panels as a one-row product does, two streams
// per thread fetched pair_prefetch_for bytes ahead, where the format reads pairs with that
// many rows (integers up to 8, floats up to 16), unless `set_pair_rows` changes it; integer
// and float panels have a limit each. On the Intel Xeon these kernels were measured on, one
// stream per thread fetched 20 KB ahead made passes of the 1.5B over 2 / 5 / 8 positions cost 1.49 /
// 1.63 / 1.83 one-row steps in int4; read as pairs 1.11 / 1.23 / 1.67 (int8: 1.23 / 1.37 /
// 1.70 against 1.06 / 1.17 / 1.41); over 5 / 9 positions in bfloat16 1.63 / 2.14 against 1.24
// / 1.70, in float32 1.45 / 1.78 against 1.03 / 1.31, and over 9 / 12 in int4 1.87 / 2.56
// against 1.59 / 1.91; with the same bits (benchmarks/pair_rows.py, NOTES.md): 16 for both
// there. On the Zen 4 (family 19h with AVX-512) integer passes of 2 to 6 rows read as pairs
// took 0.78-0.93x the time, of 7 and 8 rows 0.99-1.09x while the hardware alone fetched the
// pairs, and 0.87-0.89x (int4) and 0.86-0.93x (int8) once passes of 5 rows or more fetched
// them in software (pass_pair_prefetch); float passes of 3 rows (one pair tile) 0.80-0.96x,
// of 5 and 9 rows (in blocks) 1.02-1.87x (benchmarks/stack_ab.py with
// variants/pairs_on_every_processor.patch; variants/integer_pairs_of_one_row_on_zen4.patch
// and variants/integer_pairs_of_up_to_6_rows_on_zen4.patch undo the integers'): integers up
// to 8 rows, floats up to 3. The other AMD processors are unmeasured and stay at 1.
enum class PanelKind { integer, floating };
int64_t default_pair_rows(PanelKind kind) {
  if (is_intel()) return 16;
  if (!is_zen4()) return 1;
  return kind == PanelKind::integer ? 8 : 3;
}
std::atomic<int64_t> g_pair_rows[2] = {default_pair_rows(PanelKind::integer), default_pair_rows(PanelKind::floating)};
inline int64_t pair_rows(PanelKind kind) { return g_pair_rows[static_cast<int>(kind)].load(std::memory_order_relaxed); }

PanelKind panel_kind(const std::string& name) {
  TORCH_CHECK(name == "integer" || name == "float", "panel kind must be 'integer' or 'float', not '", name, "'");
  return name == "integer" ? PanelKind::integer : PanelKind::floating;
}
int64_t pair_rows_of(const std::string& kind) { return pair_rows(panel_kind(kind)); }
// kind: "integer", "float" or "all"
void set_pair_rows(int64_t rows, const std::string& kind) {
  TORCH_CHECK(rows >= 1, "pair rows must be at least 1, not ", rows);
  for (PanelKind each : {PanelKind::integer, PanelKind::floating})
    if (kind == "all" || panel_kind(kind) == each) g_pair_rows[static_cast<int>(each)].store(rows, std::memory_order_relaxed);
}

// pair(p, q): each region read as two streams, its first half beside its second (q = -1
// where an odd region leaves p alone)
template <class Pair>
void for_each_panel_pair(int64_t count, int64_t stride, const Pair& pair) {
  for_each_region_piece(count, stride, 2, pair_half,
                        [&](int64_t, int64_t lo, int64_t hi, int64_t begin, int64_t end) {
    const int64_t half = pair_half(lo, hi);
    for (int64_t i = begin; i < end; ++i) pair(lo + i, lo + half + i < hi ? lo + half + i : -1);
  });
}

// one(p, fetch_end): each region read as one stream fetched `ahead` bytes ahead (fetch_end:
// the region's end), fetched from its start again only where a thread's pieces break off
template <class One>
void for_each_panel_region(const uint8_t* panels, int64_t count, int64_t stride, int64_t ahead, const One& one) {
  std::vector<const uint8_t*> last(at::get_num_threads() + 1, nullptr);  // where each task's last piece ended
  for_each_region_piece(count, stride, 1, [](int64_t lo, int64_t hi) { return hi - lo; },
                        [&](int64_t task, int64_t lo, int64_t hi, int64_t begin, int64_t end) {
    const uint8_t *from = panels + (lo + begin) * stride, *fetch_end = ahead ? panels + hi * stride : nullptr;
    if (ahead && from != last[task]) prefetch_lines(from, from + ahead, fetch_end);
    last[task] = panels + (lo + end) * stride;
    for (int64_t p = lo + begin; p < lo + end; ++p) one(p, fetch_end);
  });
}

// part(first, count) over rows [0, rows) split into parts of at most max_rows, as even as
// that allows (17 rows in parts of at most 10: 9 + 8, not 10 + 7)
template <class Part>
inline void split_rows(int64_t rows, int64_t max_rows, const Part& part) {
  const int64_t parts = (rows + max_rows - 1) / max_rows;
  for (int64_t t = 0, first = 0; t < parts; ++t) {
    const int64_t count = (rows - first) / (parts - t);
    part(first, count);
    first += count;
  }
}

// The loop every panel product shares: panels split among the threads, and the m rows
// split into tiles of at most `max_rows` (split_rows). tile(rows, p, q, row0, fetch_end,
// ahead) computes rows [row0, row0 + rows) of panel p, and of panel q too when q >= 0.
//
// A product of one row (a plain decoding step), or of up to min(pair_max_rows,
// pair_rows(kind)) rows, reads one region per thread as two streams side by side (q >= 0),
// fetched pair_prefetch_for(m, pass_rows) bytes ahead (0: by the hardware alone), or with
// set_panel_streams(1) one row reads one stream fetched `stream_prefetch()` bytes ahead. In
// the host's fast spells two streams read bfloat16 panels at 80.0 GB/s against 71.8 as one,
// float32 at 83.8 against 78.9 (`benchmarks/weight_streams.py --formats bfloat16 float32
// --rows 1 --streams 1 2`). With more rows, each thread takes pieces of about an eighth of
// its share from a shared counter, each piece a stream fetched ahead, and only each panel's
// first tile fetches, pass_stream_prefetch() bytes ahead.
template <class Tile>
void for_each_panel_tile(const uint8_t* panels, int64_t count, int64_t stride, int64_t k, int64_t m,
                         int max_rows, int pair_max_rows, PanelKind kind, int64_t pass_rows, const Tile& tile) {
  if (m <= std::min<int64_t>(pair_max_rows, pair_rows(kind)) && panel_streams() == 2) {
    const int64_t ahead = pair_prefetch_for(m, pass_rows);
    for_each_panel_pair(count, stride, [&](int64_t p, int64_t q) { tile(static_cast<int>(m), p, q, 0, nullptr, ahead); });
    return;
  }
  if (m == 1) {
    const int64_t ahead = stream_prefetch();
    for_each_panel_region(panels, count, stride, ahead, [&](int64_t p, const uint8_t* fetch_end) {
      tile(1, p, -1, 0, fetch_end, ahead);
    });
    return;
  }
  // small products run on one thread: waking the others would cost more than it saves
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kPanel * k * std::max<int64_t>(1, m)));
  const int64_t ahead = pass_stream_prefetch();
  parallel_range(count, grain, [&](int64_t begin, int64_t end) {
    const uint8_t* fetch_end = ahead ? panels + end * stride : nullptr;
    if (ahead) prefetch_lines(panels + begin * stride, panels + begin * stride + ahead, fetch_end);
    for (int64_t p = begin; p < end; ++p)
      split_rows(m, max_rows, [&](int64_t row0, int64_t rows) {
        tile(static_cast<int>(rows), p, -1, row0, row0 == 0 ? fetch_end : nullptr, ahead);
      });
  });
}

// Where a pair tile read in blocks fetches: lines [from, to) past each panel's start, spread
// evenly over its steps (on: whether it fetches at all)
struct PairFetch {
  int64_t from, to;
  bool on;
  int64_t further = 0;  // bytes past those lines also fetched into L2 (0: none)
};

// part(first, count, fetch) for the groups of at most max_rows (split_rows) that take turns
// over one block of a pair: each group fetches its share of the next block's lines [line0,
// line0 + lines), `ahead` bytes past the block being read (0: nothing fetched), so that
// memory keeps streaming while the later groups read L1, and the same lines pair_l2_prefetch()
// bytes past it into L2
template <class Part>
inline void for_each_block_group(int64_t rows, int64_t max_rows, int64_t line0, int64_t lines, int64_t ahead,
                                 const Part& part) {
  const int64_t further = std::max<int64_t>(0, pair_l2_prefetch() - ahead);
  split_rows(rows, max_rows, [&](int64_t first, int64_t count) {
    part(first, count,
         PairFetch{line0 + lines * first / rows, line0 + lines * (first + count) / rows, ahead != 0, further});
  });
}

// Where an integer panel tile reads and writes: its S panels (side by side) and their first
// output columns, its first row, the output and residual from that row on, and how far ahead
// it fetches its stream (fetch_end null: not at all). With `sums`, one block of a pair read in
// blocks: groups [g0, g1) only, its accumulators taken from `sums` (16 floats per panel and
// row) unless g0 is 0 and put back unless g1 is the last group, which writes the output; it
// fetches as `fetch` says.
struct IntegerTile {
  const uint8_t* panel[2];
  int64_t col0[2];
  int64_t row0;
  float* y;
  const float* residual;
  const uint8_t* fetch_end;
  int64_t ahead;
  int64_t far;  // a pair's fetch into L2 (integer_pair_l2_prefetch_for; a single panel has none)
  float* sums = nullptr;
  int64_t g0 = 0, g1 = 0;
  PairFetch fetch{0, 0, false};
};

// Bytes of each panel per block where a pair holds more rows than one tile, as for the
// float panels (kFloatPairBlock below): 2 KB beat 1, 4 and 8 KB in int4 and int8 passes of
// the 1.5B over 9 positions (benchmarks/NOTES.md).
constexpr int64_t kIntegerPairBlock = 2048;

// The tile loop of the integer panel products (int4, int8): tile(R, S, B, IntegerTile) with R
// rows, S panels and B (whether the tile is one block of a pair read in blocks) as
// std::integral_constant: <rows, 2> where a product reads pairs of panels, otherwise <rows, 1>.
// A pair tile holds at most MaxPairRows rows; pairs of up to MaxBlockRows go through blocks
// of kIntegerPairBlock bytes of both panels in groups of rows, the first group reading a
// block from memory and the others from L1, every group fetching its share of the next block.
template <int MaxRows, int MaxPairRows, int MaxBlockRows = 2 * MaxPairRows, class Tile>
void for_each_integer_tile(const uint8_t* panels, int64_t n, int64_t k, int64_t m, int64_t stride, float* y,
                           const float* residual, const Tile& tile) {
  const int64_t groups = k / kGroup, group_bytes = stride / groups;
  for_each_panel_tile(panels, n / kPanel, stride, k, m, MaxRows, MaxBlockRows, PanelKind::integer, kPassPairRows,
                      [&](int rows, int64_t p, int64_t q, int64_t row0, const uint8_t* fetch_end, int64_t ahead) {
    const auto part = [&](int64_t first, const uint8_t* fetch_end, int64_t ahead) {
      return IntegerTile{{panels + p * stride, panels + q * stride}, {p * kPanel, q * kPanel}, first,
                         y + first * n, residual ? residual + first * n : nullptr, fetch_end, ahead,
                         integer_pair_l2_prefetch_for(rows)};
    };
    if (q < 0) {  // one panel: a pass read as one stream, or a region's odd one out, in tiles
      split_rows(rows, MaxRows, [&](int64_t first, int64_t count) {
        with_rows<MaxRows>(static_cast<int>(count), [&](auto r) {
          tile(r, std::integral_constant<int, 1>{}, std::false_type{},
               part(row0 + first, first == 0 ? fetch_end : nullptr, ahead));
        });
      });
    } else if (rows <= MaxPairRows) {  // two streams (fetched pair_prefetch_for bytes ahead)
      with_rows<MaxPairRows>(rows, [&](auto r) {
        tile(r, std::integral_constant<int, 2>{}, std::false_type{}, part(row0, nullptr, ahead));
      });
    } else {
      alignas(64) float sums[2 * MaxBlockRows * 16];
      const int64_t block = std::max<int64_t>(1, kIntegerPairBlock / group_bytes);  // groups per block
      for (int64_t g0 = 0; g0 < groups; g0 += block) {
        const int64_t g1 = std::min(groups, g0 + block);
        for_each_block_group(rows, MaxPairRows, (g0 * group_bytes + ahead) / 64, (g1 - g0) * group_bytes / 64,
                             ahead, [&](int64_t done, int64_t count, PairFetch fetch) {
          IntegerTile it = part(row0 + done, nullptr, 0);
          it.sums = sums + 2 * 16 * done;
          it.g0 = g0, it.g1 = g1;
          it.fetch = fetch;
          with_rows<MaxPairRows>(static_cast<int>(count), [&](auto r) {
            tile(r, std::integral_constant<int, 2>{}, std::true_type{}, it);
          });
        });
      }
    }
  });
}

// ------------------------------------------------------------------ SIMD layer

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
constexpr int kCols = 4;     // output columns per tile
constexpr int kMaxRows = 5;  // rows per tile
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float v) { return _mm512_set1_ps(v); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline float vsum(vfloat v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
// lane i: vsum(v[i]) for 16 vectors at once, each sum taken in vsum's pairs (so the same
// bits) in 46 operations instead of 16 x 8: each step adds the halves of two vectors at once
inline vfloat vsum_lanes(const vfloat* v) {
  vfloat h[8], q[4], r[2];
  for (int k = 0; k < 8; ++k)  // x_i + x_{i+8}
    h[k] = vadd(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // + x_{i+4}: lanes 4t..4t+3 of q[k] belong to vector 4k + t
    q[k] = vadd(_mm512_shuffle_f32x4(h[2 * k], h[2 * k + 1], 0x88), _mm512_shuffle_f32x4(h[2 * k], h[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // + x_{i+2}
    r[k] = vadd(_mm512_shuffle_ps(q[2 * k], q[2 * k + 1], 0x44), _mm512_shuffle_ps(q[2 * k], q[2 * k + 1], 0xEE));
  const vfloat s = vadd(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);  // lane 4t + u held vector 4u + t
}
// dst[i] = v[first + i] for i in [0, count)
inline void store_lanes(float* dst, vfloat v, int first, int count) {
  _mm512_mask_storeu_ps(dst - first, static_cast<__mmask16>(((1u << count) - 1) << first), v);
}
inline float vmaxall(vfloat v) { return _mm512_reduce_max_ps(v); }
// v where z >= floor, else 0 (and 0 where z is NaN)
inline vfloat vkeep_from(vfloat v, vfloat z, vfloat floor) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z, floor, _CMP_GE_OQ), v);
}
// bit i set where v[i] >= floor
inline uint32_t vmask_at_least(vfloat v, vfloat floor) { return _mm512_cmp_ps_mask(v, floor, _CMP_GE_OQ); }
inline vfloat load_bf16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vfloat load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vfloat load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// kLanes bytes of packed nibbles -> s*q + z for the low nibbles (lo) and the high ones (hi).
// The 16 possible values are made once (fma(q, s, z), as the other paths compute them) and
// looked up with a permute, which reads only the low 4 bits of each index lane.
inline void dequant_u4(const uint8_t* p, vfloat s, vfloat z, vfloat& lo, vfloat& hi) {
  const __m512 table = _mm512_fmadd_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s, z);
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_permutexvar_ps(bytes, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
// 2^n * x for whole-number n (the exponent step of exp)
inline vfloat vscale2(vfloat x, vfloat n) { return _mm512_scalef_ps(x, n); }
inline vfloat vround(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
constexpr int kCols = 2;
constexpr int kMaxRows = 3;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float v) { return _mm256_set1_ps(v); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline float vsum(vfloat v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
// lane i: vsum(v[i]) for 8 vectors at once, each sum taken in vsum's pairs (so the same bits)
inline vfloat vsum_lanes(const vfloat* v) {
  vfloat q[4], r[2];
  for (int k = 0; k < 4; ++k)  // x_i + x_{i+4}: lanes 4t..4t+3 of q[k] belong to vector 2k + t
    q[k] = vadd(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20), _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
  for (int k = 0; k < 2; ++k)  // + x_{i+2}
    r[k] = vadd(_mm256_shuffle_ps(q[2 * k], q[2 * k + 1], 0x44), _mm256_shuffle_ps(q[2 * k], q[2 * k + 1], 0xEE));
  const vfloat s = vadd(_mm256_shuffle_ps(r[0], r[1], 0x88), _mm256_shuffle_ps(r[0], r[1], 0xDD));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // lane 4t + u held vector 2u + t
}
// dst[i] = v[first + i] for i in [0, count), through the stack: a masked store
// (`vmaskmovps`) is slow on the Zen 3, where passes' attention over 5 and 9 positions took
// 0.78-0.95x the time without it (benchmarks/NOTES.md, "The Zen 3 a fourth time")
inline void store_lanes(float* dst, vfloat v, int first, int count) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  std::memcpy(dst, lanes + first, count * sizeof(float));
}
inline float vmaxall(vfloat v) {
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline vfloat vkeep_from(vfloat v, vfloat z, vfloat floor) { return _mm256_and_ps(v, _mm256_cmp_ps(z, floor, _CMP_GE_OQ)); }
inline uint32_t vmask_at_least(vfloat v, vfloat floor) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_GE_OQ)));
}
inline vfloat load_bf16(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vfloat load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vfloat load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void dequant_u4(const uint8_t* p, vfloat s, vfloat z, vfloat& lo, vfloat& hi) {
  __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))), s, z);
  hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), s, z);
}
inline vfloat vscale2(vfloat x, vfloat n) {
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(bits));
}
inline vfloat vround(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
#error "verispec kernels need AVX2, FMA and F16C (or AVX-512)"
#endif

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// exp(x) for x <= 0 (softmax after subtracting the maximum); relative error ~2e-7
inline vfloat vexp(vfloat x) {
  x = vmax(x, vset1(-87.0f));
  vfloat n = vround(vmul(x, vset1(1.44269504088896341f)));
  vfloat r = vfma(n, vset1(-0.693145751953125f), x);  // Cody-Waite: ln2 = hi + lo
  r = vfma(n, vset1(-1.428606765330187045e-06f), r);
  vfloat p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset1(1.0f)));
  return vscale2(p, n);
}

// ------------------------------------------------------------------ weight formats
//
// Each format loads the dequantised weights of one column at k-offset kk as kParts
// vectors, and names where the matching activations are. `prepare` runs once per tile
// column before its k loop (the int4 format converts its scales there).

struct F32Weights {
  static constexpr int kStep = kLanes, kParts = 1;
  const float* w;
  int64_t k;
  struct Column { const float* w; };
  Column column(int64_t col, float*) const { return {w + col * k}; }
  void prefetch(int64_t col, int64_t kk) const { _mm_prefetch(reinterpret_cast<const char*>(w + col * k + kk), _MM_HINT_T0); }
  static constexpr int kPrefetchEvery = 16;  // weights per cache line
  static void load(const Column& c, int64_t kk, vfloat* out) { out[0] = vload(c.w + kk); }
  static int64_t x_offset(int64_t kk, int) { return kk; }
  float finish(int64_t, float sum) const { return sum; }
};

template <bool kBrain>  // bfloat16 or float16
struct HalfWeights {
  static constexpr int kStep = kLanes, kParts = 1;
  const uint16_t* w;
  int64_t k;
  struct Column { const uint16_t* w; };
  Column column(int64_t col, float*) const { return {w + col * k}; }
  void prefetch(int64_t col, int64_t kk) const { _mm_prefetch(reinterpret_cast<const char*>(w + col * k + kk), _MM_HINT_T0); }
  static constexpr int kPrefetchEvery = 32;
  static void load(const Column& c, int64_t kk, vfloat* out) {
    out[0] = kBrain ? load_bf16(c.w + kk) : load_f16(c.w + kk);
  }
  static int64_t x_offset(int64_t kk, int) { return kk; }
  float finish(int64_t, float sum) const { return sum; }
};

// int8 with one scale per output channel: the scale is applied once, to the finished sum
struct Int8Weights {
  static constexpr int kStep = kLanes, kParts = 1;
  const int8_t* w;
  const float* scale;
  int64_t k;
  struct Column { const int8_t* w; };
  Column column(int64_t col, float*) const { return {w + col * k}; }
  void prefetch(int64_t col, int64_t kk) const { _mm_prefetch(reinterpret_cast<const char*>(w + col * k + kk), _MM_HINT_T0); }
  static constexpr int kPrefetchEvery = 64;
  static void load(const Column& c, int64_t kk, vfloat* out) { out[0] = load_i8(c.w + kk); }
  static int64_t x_offset(int64_t kk, int) { return kk; }
  float finish(int64_t col, float sum) const { return sum * scale[col]; }
};

// 4-bit, groups of 32 along k: 16 bytes per group (byte j holds weight j in its low nibble
// and weight j+16 in its high nibble, the layout of GGUF's Q4_0/Q4_1 blocks) and two
// float16 numbers per group, scale s and offset z: w = s*q + z.
struct Int4Weights {
  static constexpr int kStep = 2 * kLanes, kParts = 2;
  const uint8_t* q;
  const uint16_t* scales;  // [n, k/32, 2]
  int64_t k;
  struct Column { const uint8_t* q; const float* sz; };
  // converts the column's scales once into `scratch` (2 * k/32 floats)
  Column column(int64_t col, float* scratch) const {
    const int64_t groups = k / kGroup;
    const uint16_t* src = scales + col * groups * 2;
    int64_t i = 0;
    for (; i + kLanes <= groups * 2; i += kLanes) vstore(scratch + i, load_f16(src + i));
    for (; i < groups * 2; ++i) scratch[i] = half_to_float(src[i]);
    return {q + col * (k / 2), scratch};
  }
  void prefetch(int64_t col, int64_t kk) const {
    _mm_prefetch(reinterpret_cast<const char*>(q + col * (k / 2) + kk / 2), _MM_HINT_T0);
    if (kk % (16 * kGroup) == 0)  // 64 bytes of scales cover 16 groups
      _mm_prefetch(reinterpret_cast<const char*>(scales + (col * (k / kGroup) + kk / kGroup) * 2), _MM_HINT_T0);
  }
  static constexpr int kPrefetchEvery = 128;
  static void load(const Column& c, int64_t kk, vfloat* out) {
    const int64_t group = kk / kGroup, half = (kk % kGroup) / 2;
    dequant_u4(c.q + group * (kGroup / 2) + half, vset1(c.sz[2 * group]), vset1(c.sz[2 * group + 1]),
               out[0], out[1]);
  }
  static int64_t x_offset(int64_t kk, int part) {
    return (kk / kGroup) * kGroup + (kk % kGroup) / 2 + part * (kGroup / 2);
  }
  float finish(int64_t, float sum) const { return sum; }
};

// ------------------------------------------------------------------ the product

// rows [0, R) x columns [col0, col0 + C) of y, over the full k
// `next` >= 0: the first column of the block that comes after this one, fetched into the
// cache while this block computes (rows of a few kilobytes are too short for the hardware
// prefetcher to pick up in time)
template <class Fmt, int R, int C>
inline void tile(const Fmt& f, const typename Fmt::Column* cols, const float* x, int64_t ldx,
                 int64_t col0, float* y, int64_t ldy, const float* bias, const float* residual,
                 int64_t ldr, int64_t next) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t kk = 0; kk < f.k; kk += Fmt::kStep) {
    if (next >= 0 && kk % Fmt::kPrefetchEvery == 0)
      for (int c = 0; c < kCols; ++c) f.prefetch(next + c, kk);
    vfloat w[C][Fmt::kParts];
    for (int c = 0; c < C; ++c) Fmt::load(cols[c], kk, w[c]);
    for (int p = 0; p < Fmt::kParts; ++p) {
      const int64_t xo = Fmt::x_offset(kk, p);
      for (int r = 0; r < R; ++r) {
        const vfloat xv = vload(x + r * ldx + xo);
        for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, w[c][p], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t col = col0 + c;
      float v = f.finish(col, vsum(acc[r][c]));
      if (bias) v += bias[col];
      if (residual) v += residual[r * ldr + col];
      y[r * ldy + col] = v;
    }
}

template <class Fmt, int C>
inline void tile_rows(const Fmt& f, const typename Fmt::Column* cols, const float* x, int64_t ldx,
                      int64_t rows, int64_t col0, float* y, int64_t ldy, const float* bias,
                      const float* residual, int64_t ldr, int64_t next) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int64_t n = std::min<int64_t>(kMaxRows, rows - r0);
    const float* xr = x + r0 * ldx;
    float* yr = y + r0 * ldy;
    const float* rr = residual ? residual + r0 * ldr : nullptr;
    switch (n) {
      case 1: tile<Fmt, 1, C>(f, cols, xr, ldx, col0, yr, ldy, bias, rr, ldr, r0 == 0 ? next : -1); break;
      case 2: tile<Fmt, 2, C>(f, cols, xr, ldx, col0, yr, ldy, bias, rr, ldr, r0 == 0 ? next : -1); break;
      case 3: tile<Fmt, 3, C>(f, cols, xr, ldx, col0, yr, ldy, bias, rr, ldr, r0 == 0 ? next : -1); break;
#if defined(__AVX512F__)
      case 4: tile<Fmt, 4, C>(f, cols, xr, ldx, col0, yr, ldy, bias, rr, ldr, r0 == 0 ? next : -1); break;
#endif
      default: tile<Fmt, kMaxRows, C>(f, cols, xr, ldx, col0, yr, ldy, bias, rr, ldr, r0 == 0 ? next : -1); break;
    }
  }
}

template <class Fmt>
void matmul(const Fmt& f, const float* x, int64_t m, int64_t n, float* y, const float* bias,
            const float* residual) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  const int64_t scratch_per_col = 2 * (f.k / kGroup) + 1;
  // small products run on one thread: waking the others would cost more than it saves
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (kCols * f.k * std::max<int64_t>(1, m)));
  parallel_range(blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kCols * scratch_per_col);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t col0 = b * kCols;
      const int width = static_cast<int>(std::min<int64_t>(kCols, n - col0));
      typename Fmt::Column cols[kCols];
      for (int c = 0; c < width; ++c) cols[c] = f.column(col0 + c, scratch.data() + c * scratch_per_col);
      const int64_t next = (b + 2 < end || (b + 1 < end && n % kCols == 0)) ? col0 + kCols : -1;
      if (width == kCols) {
        tile_rows<Fmt, kCols>(f, cols, x, f.k, m, col0, y, n, bias, residual, n, next);
      } else {
        for (int c = 0; c < width; ++c)
          tile_rows<Fmt, 1>(f, cols + c, x, f.k, m, col0 + c, y, n, bias, residual, n, -1);
      }
    }
  });
}

void check_input(const at::Tensor& x, int64_t k, int64_t step) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weights expect ", k);
  TORCH_CHECK(k % step == 0, "k = ", k, " must be a multiple of ", step);
}

const float* optional_ptr(const c10::optional<at::Tensor>& t, int64_t numel) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == numel,
              "bias/residual must be contiguous float32 with ", numel, " elements");
  return t->data_ptr<float>();
}

template <class Fmt>
at::Tensor run(const Fmt& f, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias,
               const c10::optional<at::Tensor>& residual) {
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  matmul(f, x.data_ptr<float>(), m, n, y.data_ptr<float>(), optional_ptr(bias, n),
         optional_ptr(residual, m * n));
  return y;
}

// ------------------------------------------------------------------ bindings: products

at::Tensor linear_float(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be contiguous 2-D");
  const int64_t n = w.size(0), k = w.size(1);
  check_input(x, k, kLanes);
  switch (w.scalar_type()) {
    case at::kFloat: return run(F32Weights{w.data_ptr<float>(), k}, x, n, bias, residual);
    case at::kBFloat16:
      return run(HalfWeights<true>{reinterpret_cast<const uint16_t*>(w.data_ptr()), k}, x, n, bias, residual);
    case at::kHalf:
      return run(HalfWeights<false>{reinterpret_cast<const uint16_t*>(w.data_ptr()), k}, x, n, bias, residual);
    default: TORCH_CHECK(false, "unsupported weight dtype ", w.scalar_type());
  }
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "int8 weight expected");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "one float32 scale per row");
  const int64_t n = w.size(0), k = w.size(1);
  check_input(x, k, kLanes);
  return run(Int8Weights{w.data_ptr<int8_t>(), scale.data_ptr<float>(), k}, x, n, bias, residual);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(), "uint8 nibbles expected");
  const int64_t n = q.size(0), k = q.size(1) * 2;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.numel() == n * (k / kGroup) * 2, "float16 scales [n, k/32, 2] expected");
  check_input(x, k, kGroup);
  return run(Int4Weights{q.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()), k},
             x, n, bias, residual);
}

// The float32 weights the int4 product uses (for long prefills, which go to a dense GEMM).
at::Tensor dequantize_int4(const at::Tensor& q, const at::Tensor& scales) {
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / kGroup;
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* op = out.data_ptr<float>();
  parallel_range(n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t g = 0; g < groups; ++g) {
        const float s = half_to_float(sp[(row * groups + g) * 2]), z = half_to_float(sp[(row * groups + g) * 2 + 1]);
        const uint8_t* b = qp + row * (k / 2) + g * (kGroup / 2);
        float* dst = op + row * k + g * kGroup;
        for (int j = 0; j < kGroup / 2; ++j) {
          dst[j] = std::fma(static_cast<float>(b[j] & 15), s, z);
          dst[j + kGroup / 2] = std::fma(static_cast<float>(b[j] >> 4), s, z);
        }
      }
  });
  return out;
}

// ------------------------------------------------------------------ 16 lanes: one panel's columns
//
// The panel kernels below keep a panel's 16 output columns in 16 lanes: one 512-bit
// register with AVX-512, two 256-bit registers (columns 0-7 and 8-15) with AVX2. Every
// operation here works lane by lane or is exact in integers, so both give the same bits.
// The integer dot products are `vpdpbusd` and `vpdpwssd` with AVX-512 VNNI; without VNNI
// they are built from `vpmaddubsw` and `vpmaddwd`, which give the same exact sums as long as
// their 16-bit pair sums cannot saturate (the kernels below keep to that).
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kWideLanes = true;
struct Lanes { __m512 v; };    // 16 floats
struct ILanes { __m512i v; };  // 16 int32 (or 32 int16, or 64 bytes)
inline Lanes lzero() { return {_mm512_setzero_ps()}; }
inline Lanes lset1(float v) { return {_mm512_set1_ps(v)}; }
inline Lanes lload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void lstore(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
inline Lanes ladd(Lanes a, Lanes b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Lanes lmul(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Lanes ldiv(Lanes a, Lanes b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Lanes lmin(Lanes a, Lanes b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Lanes lmax(Lanes a, Lanes b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Lanes lfma(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline float lmaxall(Lanes a) { return _mm512_reduce_max_ps(a.v); }
inline Lanes labs(Lanes a) {
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7FFFFFFF)))};
}
inline Lanes lfloat(ILanes a) { return {_mm512_cvtepi32_ps(a.v)}; }  // int32 -> float
inline Lanes lbits(ILanes a) { return {_mm512_castsi512_ps(a.v)}; }   // the same bits as floats
inline ILanes lround(Lanes a) { return {_mm512_cvtps_epi32(a.v)}; }   // to the nearest, ties to even
inline Lanes lhalves(const uint8_t* p) {  // 16 float16 (32 bytes) -> floats
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Lanes lhalves_low(ILanes a) { return {_mm512_cvtph_ps(_mm512_cvtepi32_epi16(a.v))}; }  // each lane's low 16 bits
inline ILanes izero() { return {_mm512_setzero_si512()}; }
inline ILanes iload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }  // 64 bytes
inline void istore(void* p, ILanes a) { _mm512_storeu_si512(p, a.v); }
inline ILanes iset1(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline ILanes ibytes(int8_t v) { return {_mm512_set1_epi8(v)}; }
inline ILanes iand(ILanes a, ILanes b) { return {_mm512_and_si512(a.v, b.v)}; }
inline ILanes iandnot(ILanes a, ILanes b) { return {_mm512_andnot_si512(a.v, b.v)}; }  // ~a & b
inline ILanes ior(ILanes a, ILanes b) { return {_mm512_or_si512(a.v, b.v)}; }
inline ILanes iadd(ILanes a, ILanes b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline ILanes iadd16(ILanes a, ILanes b) { return {_mm512_add_epi16(a.v, b.v)}; }
inline ILanes isrl16(ILanes a, int n) { return {_mm512_srli_epi16(a.v, n)}; }
inline ILanes isrl32(ILanes a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline ILanes isll32(ILanes a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline ILanes isra32(ILanes a, int n) { return {_mm512_srai_epi32(a.v, n)}; }
inline int32_t isum(ILanes a) { return _mm512_reduce_add_epi32(a.v); }
inline ILanes iwiden8(const uint8_t* p) {  // 32 int8 (32 bytes) -> 32 int16
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 32 int32 in [-128, 127] (a, then b) -> 32 bytes
inline void store_i8(int8_t* p, ILanes a, ILanes b) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16), _mm512_cvtepi32_epi8(b.v));
}
// 32 int32 in [-32768, 32767] (a, then b) -> 64 bytes
inline void store_i16(void* p, ILanes a, ILanes b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p) + 1, _mm512_cvtepi32_epi16(b.v));
}
// products of unsigned and signed bytes, each adjacent pair summed to int16 (saturating)
inline ILanes imul_u8_pairs(ILanes u, ILanes s) { return {_mm512_maddubs_epi16(u.v, s.v)}; }
// products of int16, each adjacent pair summed to int32
inline ILanes imul_i16_pairs(ILanes a, ILanes b) { return {_mm512_madd_epi16(a.v, b.v)}; }
inline void hold(ILanes& a) { asm("" : "+v"(a.v)); }  // see the AVX2 hold below
#else  // AVX2 (the SIMD layer above refuses anything less)
constexpr bool kWideLanes = false;
struct Lanes { __m256 lo, hi; };
struct ILanes { __m256i lo, hi; };
inline Lanes lzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes lset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Lanes lload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void lstore(float* p, Lanes a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Lanes ladd(Lanes a, Lanes b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Lanes lmul(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Lanes ldiv(Lanes a, Lanes b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Lanes lmin(Lanes a, Lanes b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Lanes lmax(Lanes a, Lanes b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Lanes lfma(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float lmaxall(Lanes a) { return vmaxall(_mm256_max_ps(a.lo, a.hi)); }
inline Lanes labs(Lanes a) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask)};
}
inline Lanes lfloat(ILanes a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline Lanes lbits(ILanes a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
inline ILanes lround(Lanes a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline Lanes lhalves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m128i low_halves(__m256i v) {  // each of 8 lanes' low 16 bits, in order
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_setzero_si256());
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
inline Lanes lhalves_low(ILanes a) { return {_mm256_cvtph_ps(low_halves(a.lo)), _mm256_cvtph_ps(low_halves(a.hi))}; }
inline ILanes izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline ILanes iload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline void istore(void* p, ILanes a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p) + 1, a.hi);
}
inline ILanes iset1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline ILanes ibytes(int8_t v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
inline ILanes iand(ILanes a, ILanes b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline ILanes iandnot(ILanes a, ILanes b) { return {_mm256_andnot_si256(a.lo, b.lo), _mm256_andnot_si256(a.hi, b.hi)}; }
inline ILanes ior(ILanes a, ILanes b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline ILanes iadd(ILanes a, ILanes b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline ILanes iadd16(ILanes a, ILanes b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
inline ILanes isrl16(ILanes a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
inline ILanes isrl32(ILanes a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline ILanes isll32(ILanes a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline ILanes isra32(ILanes a, int n) { return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)}; }
inline int32_t isum(ILanes a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
  return _mm_cvtsi128_si32(q);
}
inline ILanes iwiden8(const uint8_t* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline __m256i narrow_i16(ILanes a) {  // 16 int32 -> 16 int16 in order (packs works within 128-bit halves)
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
}
inline void store_i8(int8_t* p, ILanes a, ILanes b) {
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(narrow_i16(a), narrow_i16(b)), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bytes);
}
inline void store_i16(void* p, ILanes a, ILanes b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_i16(a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p) + 1, narrow_i16(b));
}
inline ILanes imul_u8_pairs(ILanes u, ILanes s) {
  return {_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi)};
}
inline ILanes imul_i16_pairs(ILanes a, ILanes b) { return {_mm256_madd_epi16(a.lo, b.lo), _mm256_madd_epi16(a.hi, b.hi)}; }
// `a` kept in its registers at this point. Without VNNI the int4 tile's sums are chains of
// 16-bit additions, which GCC reassociated: it took a group's products first, kept them on the
// stack and added them up after (the one-row pair tile stored 38 registers there, now 8).
// Held after each step, the tiles keep their chains; the int8 tile spilled more when held, so
// it is left as GCC arranges it (benchmarks/NOTES.md has the timings).
inline void hold(ILanes& a) { asm("" : "+x"(a.lo), "+x"(a.hi)); }
#endif

// the 4 bytes at p in every int32 lane
inline ILanes broadcast_dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return iset1(v);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kNativeDot = true;
// acc + the sums of 2 products of int16, per int32 lane
inline ILanes idot_i16(ILanes acc, ILanes a, ILanes b) { return {_mm512_dpwssd_epi32(acc.v, a.v, b.v)}; }
// the same with b one pair of int16 at `b`, broadcast by the instruction itself: one
// micro-fused operation where a broadcast of its own takes a second. A core keeps fewer lines
// in flight the more operations each line costs, and one-row int8 steps took 0.98x the time
// on the Xeon without AMX (benchmarks/NOTES.md, "The Xeon without AMX a third time")
inline ILanes idot_i16_at(ILanes acc, ILanes a, const int32_t* b) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(a.v), "m"(*b));
  return acc;
}
// acc + the sums of 4 products of unsigned bytes u and the 4 signed bytes at `s`, per int32
// lane (exact), broadcast the same way (int4's one-row steps 0.995x the time, passes over 5
// positions 0.976x)
inline ILanes idot_u8_at(ILanes acc, ILanes u, const int8_t* s) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(u.v), "m"(*reinterpret_cast<const int32_t*>(s)));
  return acc;
}
#else
constexpr bool kNativeDot = false;
// exact while each pair of products fits in int16 (unsigned bytes of at most 15 times
// signed bytes: 2 * 15 * 127 = 3810)
inline ILanes idot_u8_at(ILanes acc, ILanes u, const int8_t* s) {
  return iadd(acc, imul_i16_pairs(imul_u8_pairs(u, broadcast_dword(s)), iset1(0x00010001)));
}
inline ILanes idot_i16(ILanes acc, ILanes a, ILanes b) { return iadd(acc, imul_i16_pairs(a, b)); }
inline ILanes idot_i16_at(ILanes acc, ILanes a, const int32_t* b) { return idot_i16(acc, a, iset1(*b)); }
#endif

// ------------------------------------------------------------------ int4 x int8 panels
//
// The same int4 weights, multiplied as integers (`vpdpbusd` with VNNI: 64 products of
// unsigned 8-bit weights and signed 8-bit activations per instruction) instead of being
// dequantised to float32: the float path spends 4 FMAs per 64 products and is compute-bound
// on a fast memory system, where this one is close to memory-bound at one row, and each
// extra row of a verification pass costs about a quarter as much.
//
// Activations are rounded to int8 per row in groups of 32 along k: dx = max|x| / 127,
// xq = round(x / dx), as llama.cpp does for its 4-bit formats. Over one group the product
// is then exactly s*dx*sum(q*xq) + z*dx*sum(xq) = sum(w * dx*xq): the int4 weights times
// the rounded activations, with float rounding only in the last two multiply-adds. Rows
// are rounded one by one, so row i of an m-row call is still bit-identical to a 1-row call.
//
// Layout ("panels"): 16 output columns per panel; per panel and group of 32, 320 bytes:
// the 16 scales s and 16 offsets z as float16 (one cache line), then 4 x 64 bytes in which
// dword j of chunk t holds column j's canonical group bytes 4t..4t+3, so its low nibbles
// are weights 4t..4t+3 and its high nibbles weights 16+4t..16+4t+3. One 64-byte load gives
// two dot-product weight operands; int32 lane j accumulates column j.
constexpr int64_t kPanelGroupBytes = 64 + 256;  // scales, then nibbles
// rows per tile: the register budget is 32 zmm with AVX-512, 16 ymm (holding half as many
// lanes) with AVX2
constexpr int kPanelRows = kWideLanes ? 10 : 5;
// The most rows an integer tile reads two panels with: 8 fill the 32 zmm registers (9 rows
// spilled and lost to one panel at a time); with 16 ymm registers, one row.
constexpr int kPairRows = kWideLanes ? 8 : 1;
// Each thread's stream of panels is fetched ahead in software (pass_stream_prefetch() bytes
// in passes): the hardware prefetcher alone falls behind once a tile has several rows (9
// rows: 1.6 ms -> 3.0 ms per 1.5B layer when this kernel was written).

struct RoundedRows {  // activations per row in groups of 32: int8 values, dx, dx * sum(xq)
  std::vector<int8_t> q;
  std::vector<float> dx, c;
  int64_t groups;
};

// One group of 32 activations rounded to integers in [-levels, levels]: dx = max|x| / levels,
// q = round-half-even(x / dx) in two sets of 16 int32 lanes; returns dx.
inline float round_group(const float* src, float levels, ILanes& qa, ILanes& qb) {
  const Lanes a = lload(src), b = lload(src + 16);
  const float amax = lmaxall(lmax(labs(a), labs(b)));
  const float dx = amax / levels;
  qa = qb = izero();
  if (amax > 0.0f) {
    const Lanes d = lset1(dx), lim = lset1(levels), neg = lset1(-levels);
    // clamp before converting: x / dx can exceed the limit by a rounding error, never by 0.5
    qa = lround(lmin(lmax(ldiv(a, d), neg), lim));
    qb = lround(lmin(lmax(ldiv(b, d), neg), lim));
  }
  return dx;
}

// The same rounding as quant.round_activations: dx = amax / 127, xq = round-half-even(x / dx).
RoundedRows round_rows(const float* x, int64_t m, int64_t k) {
  RoundedRows r;
  r.groups = k / kGroup;
  r.q.resize(m * k);
  r.dx.resize(m * r.groups);
  r.c.resize(m * r.groups);
  for (int64_t i = 0; i < m * r.groups; ++i) {
    ILanes qa, qb;
    const float dx = round_group(x + i * kGroup, 127.0f, qa, qb);
    store_i8(r.q.data() + i * kGroup, qa, qb);
    r.dx[i] = dx;
    r.c[i] = dx * static_cast<float>(isum(iadd(qa, qb)));
  }
  return r;
}

// A pair read in blocks fetches lines [from, to) of both panels spread evenly over a tile's
// steps (Bresenham's spread: `owed` counts in units of 1 / steps of a line), and into L2
// the lines f.further bytes past those.
struct SpreadFetch {
  const uint8_t *a, *b;
  int64_t next, lines, steps, owed = 0, further;
  SpreadFetch(const uint8_t* pa, const uint8_t* pb, PairFetch f, int64_t steps)
      : a(pa), b(pb), next(f.from), lines(f.on ? f.to - f.from : 0), steps(steps), further(f.further) {}
  VERISPEC_PREFETCHES void step() {
    for (owed += lines; owed >= steps; owed -= steps, ++next) {
      fetch_pair_ahead(a + 64 * next, 0, further, 1);
      fetch_pair_ahead(b + 64 * next, 0, further, 1);
    }
  }
};

// An integer tile's N accumulators where it starts: zeros, or where the block before left them
template <int N, bool Blocks>
inline void start_sums(const IntegerTile& tile, Lanes* acc) {
  for (int i = 0; i < N; ++i) acc[i] = Blocks && tile.g0 > 0 ? lload(tile.sums + 16 * i) : lzero();
}

// ...and where it ends: true where a later block goes on from them (they are put back)
template <int N, bool Blocks>
inline bool put_back_sums(const IntegerTile& tile, const Lanes* acc, int64_t groups) {
  if (!Blocks || tile.g1 == groups) return false;
  for (int i = 0; i < N; ++i) lstore(tile.sums + 16 * i, acc[i]);
  return true;
}

// rows [0, R) x the 16 columns of one panel, over all groups. Each row's int32 sums over a
// group are exact whatever the order; its float accumulator sees the same two
// multiply-adds per group in every tile, so the result does not depend on R (nor on the
// instruction set: the integer sums are the same, the float work lane by lane the same).
// Not inlined: each tile size keeps its own register allocation.
template <int R, int S, bool Blocks = false>
__attribute__((noinline)) void panel_tile(const IntegerTile& tile, int64_t groups, const RoundedRows& xr, int64_t k,
                                          int64_t ldy, const float* bias) {
  const uint8_t *const *panel = tile.panel, *fetch_end = tile.fetch_end;
  const int64_t *col0 = tile.col0, row0 = tile.row0, ahead = tile.ahead;
  float* y = tile.y;
  const float* residual = tile.residual;
  // Independent int32 sums per row with VNNI, so that a row is not held up by the latency
  // of `vpdpbusd`. Without it, each row sums a group's byte pairs in 16 bits (8 pair sums of
  // at most 2 * 15 * 127 each: no overflow) and widens them once per group, which takes
  // half the multiplies of widening every pair sum.
  constexpr int kChains = kNativeDot ? std::max(1, (R <= 2 ? 4 : (R <= 4 ? 2 : 1)) / S) : 1;
  constexpr int N = S * R;  // row r of panel j at j * R + r
  // With an even number of chains, the low nibbles' products go to the even chains and the
  // high nibbles' to the odd ones. Those may then take each high nibble in place, 16 times
  // its value, saving a shift per line; their sum is divided by 16 once per group (exactly:
  // it is a multiple of 16). Fewer instructions per line read a point more of a fast
  // memory system's bandwidth. (The 16-bit pair sums without VNNI would overflow.)
  constexpr bool kHighInPlace = kNativeDot && kChains % 2 == 0;
  const ILanes low = ibytes(15);
  Lanes acc[N];
  start_sums<N, Blocks>(tile, acc);
  const int8_t* xq = xr.q.data() + row0 * k;
  const float* dx = xr.dx.data() + row0 * groups;
  const float* cx = xr.c.data() + row0 * groups;
  const int64_t g_begin = Blocks ? tile.g0 : 0, g_end = Blocks ? tile.g1 : groups;
  SpreadFetch spread(panel[0], panel[S - 1], tile.fetch, g_end - g_begin);
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* p[S];
    for (int j = 0; j < S; ++j) p[j] = panel[j] + g * kPanelGroupBytes;
    if (Blocks)
      spread.step();
    else if (fetch_end && p[0] + ahead + kPanelGroupBytes <= fetch_end)
      fetch_ahead(p[0], ahead, 5);
    else if (S == 2 && ahead)
      for (int j = 0; j < S; ++j) fetch_pair_ahead(p[j], ahead, tile.far, 5);
    ILanes sum[N][kChains];
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < kChains; ++c) sum[i][c] = izero();
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < S; ++j) {
        const ILanes v = iload(p[j] + 64 + 64 * t);
        const ILanes lo = iand(v, low);
        const ILanes hi = kHighInPlace ? iandnot(low, v) : iand(isrl16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* xg = xq + r * k + g * kGroup;
          if (kNativeDot) {
            ILanes& a = sum[j * R + r][(2 * t) % kChains];
            a = idot_u8_at(a, lo, xg + 4 * t);
            ILanes& b = sum[j * R + r][(2 * t + 1) % kChains];
            b = idot_u8_at(b, hi, xg + 16 + 4 * t);
          } else {
            ILanes& a = sum[j * R + r][0];
            a = iadd16(a, imul_u8_pairs(lo, broadcast_dword(xg + 4 * t)));
            a = iadd16(a, imul_u8_pairs(hi, broadcast_dword(xg + 16 + 4 * t)));
            hold(a);
          }
        }
      }
    for (int j = 0; j < S; ++j) {
      const Lanes s = lhalves(p[j]), z = lhalves(p[j] + 32);
      for (int r = 0; r < R; ++r) {
        ILanes total = sum[j * R + r][0];
        if (!kNativeDot) {
          total = imul_i16_pairs(total, iset1(0x00010001));  // the 16-bit sums widened
        } else if (kHighInPlace) {
          ILanes high = sum[j * R + r][1];
          for (int c = 2; c < kChains; c += 2) {
            total = iadd(total, sum[j * R + r][c]);
            high = iadd(high, sum[j * R + r][c + 1]);
          }
          total = iadd(total, isra32(high, 4));
        } else {
          for (int c = 1; c < kChains; ++c) total = iadd(total, sum[j * R + r][c]);
        }
        const Lanes sd = lmul(s, lset1(dx[r * groups + g]));
        Lanes& out = acc[j * R + r];
        out = lfma(lfloat(total), sd, out);
        out = lfma(z, lset1(cx[r * groups + g]), out);
      }
    }
  }
  if (put_back_sums<N, Blocks>(tile, acc, groups)) return;
  for (int j = 0; j < S; ++j)
    for (int r = 0; r < R; ++r) {
      Lanes v = acc[j * R + r];
      if (bias) v = ladd(v, lload(bias + col0[j]));
      if (residual) v = ladd(v, lload(residual + r * ldy + col0[j]));
      lstore(y + r * ldy + col0[j], v);
    }
}

void matmul_panels(const uint8_t* panels, int64_t n, int64_t k, const float* x, int64_t m, float* y,
                   const float* bias, const float* residual) {
  const RoundedRows xr = round_rows(x, m, k);
  const int64_t groups = k / kGroup, stride = groups * kPanelGroupBytes;
  for_each_integer_tile<kPanelRows, kPairRows>(panels, n, k, m, stride, y, residual,
                                    [&](auto rows, auto streams, auto blocks, const IntegerTile& tile) {
    panel_tile<decltype(rows)::value, decltype(streams)::value, decltype(blocks)::value>(tile, groups, xr, k, n, bias);
  });
}

// ------------------------------------------------------------------ bindings: panels

void check_panels(const at::Tensor& panels) {
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kByte && panels.dim() == 3 &&
              panels.size(2) == kPanelGroupBytes && panels.is_contiguous(),
              "int4 panels must be contiguous uint8 [n/16, k/32, 320]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0, "int4 panels must be 64-byte aligned");
}

at::Tensor linear_int4_panels(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                              const c10::optional<at::Tensor>& residual) {
  check_panels(panels);
  const int64_t n = panels.size(0) * kPanel, k = panels.size(1) * kGroup, m = x.size(0);
  check_input(x, k, kGroup);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  matmul_panels(panels.data_ptr<uint8_t>(), n, k, x.data_ptr<float>(), m, y.data_ptr<float>(),
                optional_ptr(bias, n), optional_ptr(residual, m * n));
  return y;
}

// canonical (nibbles [n, k/2], scales [n, k/32, 2]) -> panels [n/16, k/32, 320]
at::Tensor int4_to_panels(const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous(), "uint8 nibbles expected");
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(n % kPanel == 0, "n = ", n, " must be a multiple of ", kPanel);
  TORCH_CHECK(k % kGroup == 0, "k = ", k, " must be a multiple of ", kGroup);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == n * groups * 2,
              "float16 scales [n, k/32, 2] expected");
  at::Tensor out = at::empty({n / kPanel, groups, kPanelGroupBytes}, at::kByte);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  uint8_t* op = out.data_ptr<uint8_t>();
  parallel_range(n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* dst = op + (p * groups + g) * kPanelGroupBytes;
        uint16_t* sz = reinterpret_cast<uint16_t*>(dst);
        for (int j = 0; j < kPanel; ++j) {
          const int64_t col = p * kPanel + j;
          sz[j] = sp[(col * groups + g) * 2];
          sz[kPanel + j] = sp[(col * groups + g) * 2 + 1];
          for (int t = 0; t < 4; ++t)
            std::memcpy(dst + 64 + 64 * t + 4 * j, qp + col * (k / 2) + g * (kGroup / 2) + 4 * t, 4);
        }
      }
  });
  return out;
}

// The float32 weights of the panel layout, the same values as dequantize_int4 gives.
at::Tensor dequantize_int4_panels(const at::Tensor& panels) {
  check_panels(panels);
  const int64_t count = panels.size(0), groups = panels.size(1), n = count * kPanel, k = groups * kGroup;
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  parallel_range(count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* src = pp + (p * groups + g) * kPanelGroupBytes;
        const uint16_t* sz = reinterpret_cast<const uint16_t*>(src);
        for (int j = 0; j < kPanel; ++j) {
          const float s = half_to_float(sz[j]), z = half_to_float(sz[kPanel + j]);
          float* dst = op + (p * kPanel + j) * k + g * kGroup;
          for (int t = 0; t < 4; ++t)
            for (int b = 0; b < 4; ++b) {
              const uint8_t byte = src[64 + 64 * t + 4 * j + b];
              dst[4 * t + b] = std::fma(static_cast<float>(byte & 15), s, z);
              dst[16 + 4 * t + b] = std::fma(static_cast<float>(byte >> 4), s, z);
            }
        }
      }
  });
  return out;
}
// ------------------------------------------------------------------ panels: float32 / bfloat16 / float16, int8
//
// The same products as `linear_float` and `linear_int8`, on weights rearranged so that
// each thread reads one sequential stream. Row-major weights make a tile of 4 columns
// read 4 streams of a few kilobytes each; the hardware prefetcher never gets ahead of
// them, and one core read int8 weights at three quarters of what a plain sum of the same
// bytes reads (benchmarks/weight_streams.py --threads 1 compares the two layouts).
//
// Layout: panels [n/16, k/L, 16, L] of the weight's own type, L = 4 bytes / element size
// (float32 1, 16-bit floats 2, int8 4): every 64-byte line holds L consecutive inputs of
// 16 output columns, so float lane j accumulates column j and no horizontal sum is needed.
// Each row keeps 4 float accumulators, input kk going to accumulator kk % 4, summed as
// (a0 + a1) + (a2 + a3) at the end: the same order in every tile, so the result does not
// depend on how many rows share the call.
constexpr int kFloatPanelRows = kWideLanes ? 6 : 2;  // 4 accumulators per row: 24 of the 32 zmm, 16 of the 16 ymm

// kPassPairRows: from how many rows a pass that reads pairs fetches them as a pass (above)
struct PanelF32 {
  static constexpr int kPerLine = 1;
  static constexpr int64_t kPassPairRows = ::kPassPairRows;
  static void unpack(ILanes v, Lanes* w) { w[0] = lbits(v); }
};
struct PanelBF16 {  // dword j: column j's input 2t in the low half, 2t+1 in the high half
  static constexpr int kPerLine = 2;
  static constexpr int64_t kPassPairRows = 3;
  static void unpack(ILanes v, Lanes* w) {
    w[0] = lbits(isll32(v, 16));
    w[1] = lbits(iand(v, iset1(static_cast<int32_t>(0xFFFF0000u))));
  }
};
struct PanelF16 {
  static constexpr int kPerLine = 2;
  static constexpr int64_t kPassPairRows = 3;
  static void unpack(ILanes v, Lanes* w) {
    w[0] = lhalves_low(v);
    w[1] = lhalves_low(isrl32(v, 16));
  }
};

// rows [0, R) x the 16 columns of one panel, over all k; `fetch_end` (or null): where this
// thread's stream ends, for fetching `ahead` bytes ahead
template <class P, int R>
__attribute__((noinline)) void float_panel_tile(const uint8_t* panel, int64_t k, const float* x, float* y,
                                                int64_t ldy, int64_t col0, const float* bias, const float* residual,
                                                const uint8_t* fetch_end, int64_t ahead) {
  constexpr int L = P::kPerLine, kLinesPerStep = 4 / L;  // one step: 4 inputs, one per accumulator
  Lanes a0[R], a1[R], a2[R], a3[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = a2[r] = a3[r] = lzero();
  for (int64_t kk = 0; kk < k; kk += 4) {
    const uint8_t* line = panel + kk / L * 64;
    if (fetch_end && line + ahead < fetch_end)
      for (int l = 0; l < kLinesPerStep; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(line + ahead + 64 * l), _MM_HINT_T0);
    Lanes w[4];
    for (int l = 0; l < kLinesPerStep; ++l) P::unpack(iload(line + 64 * l), w + l * L);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + kk;
      a0[r] = lfma(w[0], lset1(xr[0]), a0[r]);
      a1[r] = lfma(w[1], lset1(xr[1]), a1[r]);
      a2[r] = lfma(w[2], lset1(xr[2]), a2[r]);
      a3[r] = lfma(w[3], lset1(xr[3]), a3[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Lanes v = ladd(ladd(a0[r], a1[r]), ladd(a2[r], a3[r]));
    if (bias) v = ladd(v, lload(bias + col0));
    if (residual) v = ladd(v, lload(residual + r * ldy + col0));
    lstore(y + r * ldy + col0, v);
  }
}

// Steps kk in [k0, k1) of rows [0, R) x the 16 columns of two panels read side by side, each
// row's 8 accumulators (4 per panel) taken from `sums` and put back: the same sums in the same
// order as float_panel_tile<P, R>, split where a caller splits k.
template <class P, int R>
__attribute__((noinline)) void float_pair_steps(const uint8_t* pa, const uint8_t* pb, int64_t k0, int64_t k1,
                                                const float* x, int64_t ldx, Lanes (*sums)[8], PairFetch fetch) {
  constexpr int L = P::kPerLine, kLinesPerStep = 4 / L;
  Lanes a[4][R], b[4][R];  // accumulator i of row r, panel a and panel b
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < R; ++r) a[i][r] = sums[r][i], b[i][r] = sums[r][4 + i];
  SpreadFetch spread(pa, pb, fetch, (k1 - k0) / 4);
  for (int64_t kk = k0; kk < k1; kk += 4) {
    const uint8_t *la = pa + kk / L * 64, *lb = pb + kk / L * 64;
    spread.step();
    Lanes wa[4], wb[4];
    for (int l = 0; l < kLinesPerStep; ++l) {
      P::unpack(iload(la + 64 * l), wa + l * L);
      P::unpack(iload(lb + 64 * l), wb + l * L);
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) {
        const Lanes xi = lset1(x[r * ldx + kk + i]);
        a[i][r] = lfma(wa[i], xi, a[i][r]);
        b[i][r] = lfma(wb[i], xi, b[i][r]);
      }
  }
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < R; ++r) sums[r][i] = a[i][r], sums[r][4 + i] = b[i][r];
}

// The most rows a float tile reads two panels with at once: 8 accumulators per row, 24 of the
// 32 zmm at 3 rows; with 16 ymm registers, one row.
constexpr int kFloatPairRows = kWideLanes ? 3 : 1;
// The most rows a float product reads as pairs: more rows than one tile holds go through
// each block of kFloatPairBlock bytes of both panels in groups, the first group reading it
// from memory and the others from L1. Blocks of 2 KB per panel beat 4 and 8 KB in passes of
// the 1.5B over 5 and 8 positions (benchmarks/NOTES.md): the block being read, the next one
// being fetched and the rows' inputs for it all stay in L1.
constexpr int kFloatPairMaxRows = 16;
constexpr int64_t kFloatPairBlock = 2048;

// rows [0, m) x the 16 columns of panels pa and pb (m <= kFloatPairMaxRows), both streams
// fetched `ahead` bytes ahead (0: not at all). With several groups of rows the fetches are
// spread over all of them, so that memory keeps streaming while the later groups read L1.
template <class P>
void float_panel_pair(const uint8_t* pa, const uint8_t* pb, int64_t k, const float* x, int64_t m, float* y,
                      int64_t ldy, int64_t col_a, int64_t col_b, const float* bias, const float* residual,
                      int64_t ahead) {
  constexpr int L = P::kPerLine;
  const int64_t block = m <= kFloatPairRows ? k : kFloatPairBlock / 64 * L;  // inputs per block
  Lanes sums[kFloatPairMaxRows][8];
  for (int64_t r = 0; r < m; ++r)
    for (int i = 0; i < 8; ++i) sums[r][i] = lzero();
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const int64_t k1 = std::min(k, k0 + block);
    for_each_block_group(m, kFloatPairRows, k0 / L + ahead / 64, (k1 - k0) / L, ahead,
                         [&](int64_t row0, int64_t rows, PairFetch fetch) {
      with_rows<kFloatPairRows>(static_cast<int>(rows), [&](auto r) {
        float_pair_steps<P, decltype(r)::value>(pa, pb, k0, k1, x + row0 * k, k, sums + row0, fetch);
      });
    });
  }
  const int64_t cols[2] = {col_a, col_b};
  for (int64_t r = 0; r < m; ++r)
    for (int j = 0; j < 2; ++j) {
      const Lanes* s = sums[r] + 4 * j;
      Lanes v = ladd(ladd(s[0], s[1]), ladd(s[2], s[3]));
      if (bias) v = ladd(v, lload(bias + cols[j]));
      if (residual) v = ladd(v, lload(residual + r * ldy + cols[j]));
      lstore(y + r * ldy + cols[j], v);
    }
}

template <class P>
void matmul_float_panels(const uint8_t* panels, int64_t n, int64_t k, const float* x, int64_t m, float* y,
                         const float* bias, const float* residual) {
  const int64_t stride = kPanel * k * 4 / P::kPerLine;
  for_each_panel_tile(panels, n / kPanel, stride, k, m, kFloatPanelRows, kFloatPairMaxRows, PanelKind::floating,
                      P::kPassPairRows,
                      [&](int rows, int64_t p, int64_t q, int64_t row0, const uint8_t* fetch_end, int64_t ahead) {
    if (q >= 0) {  // two streams
      float_panel_pair<P>(panels + p * stride, panels + q * stride, k, x + row0 * k, rows, y + row0 * n, n,
                          p * kPanel, q * kPanel, bias, residual ? residual + row0 * n : nullptr, ahead);
      return;
    }
    // one panel: a tile of a pass read as one stream, or the odd one out of a region read as
    // pairs, whose rows may need more than one tile
    split_rows(rows, kFloatPanelRows, [&](int64_t first, int64_t count) {
      const int64_t r0 = row0 + first;
      with_rows<kFloatPanelRows>(static_cast<int>(count), [&](auto r) {
        float_panel_tile<P, decltype(r)::value>(panels + p * stride, k, x + r0 * k, y + r0 * n, n, p * kPanel,
                                                bias, residual ? residual + r0 * n : nullptr,
                                                first == 0 ? fetch_end : nullptr, ahead);
      });
    });
  });
}

// x [m, k] @ W^T for W in the panel layout [n/16, k/L, 16, L] (float32, bfloat16 or float16)
at::Tensor linear_float_panels(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(panels.device().is_cpu() && panels.dim() == 4 && panels.size(2) == kPanel &&
              panels.size(3) * panels.element_size() == 4 && panels.is_contiguous(),
              "panels must be contiguous [n/16, k/L, 16, L] with L * element size = 4 bytes");
  const int64_t n = panels.size(0) * kPanel, k = panels.size(1) * panels.size(3), m = x.size(0);
  check_input(x, k, 4);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(panels.data_ptr());
  const float *xp = x.data_ptr<float>(), *bp = optional_ptr(bias, n), *rp = optional_ptr(residual, m * n);
  float* yp = y.data_ptr<float>();
  switch (panels.scalar_type()) {
    case at::kFloat: matmul_float_panels<PanelF32>(w, n, k, xp, m, yp, bp, rp); break;
    case at::kBFloat16: matmul_float_panels<PanelBF16>(w, n, k, xp, m, yp, bp, rp); break;
    case at::kHalf: matmul_float_panels<PanelF16>(w, n, k, xp, m, yp, bp, rp); break;
    default: TORCH_CHECK(false, "float panels must be float32, bfloat16 or float16, not ", panels.scalar_type());
  }
  return y;
}

// from how many rows a pass in `weights` that reads pairs fetches them pass_pair_prefetch() ahead
int64_t pass_pair_rows_of(const std::string& weights) {
  if (weights == "int4" || weights == "int8" || weights == "float32") return kPassPairRows;
  if (weights == "bfloat16") return PanelBF16::kPassPairRows;
  if (weights == "float16") return PanelF16::kPassPairRows;
  TORCH_CHECK(false, "weights must be 'int4', 'int8', 'float32', 'bfloat16' or 'float16', not '", weights, "'");
}

// int8 weights x activations in 16-bit fixed point (`vpdpwssd` with VNNI, 32 products per
// instruction; `vpmaddwd` without).
//
// Converting int8 weights to float32 costs 4 shifts, 4 conversions and, per row, 4 FMAs
// per 64 weights: a 5-row verification pass was compute-bound at half the bandwidth.
// Instead each row is rounded, per group of 32 inputs, to int16: dx = max|x| / 32767,
// xq = round(x / dx). That is a relative error of at most 1.5e-5 of the group's largest
// value, a hundred times finer than bfloat16's rounding, so the format stays weight-only
// in effect. Each 64-byte line holds inputs 4t, 4t+1 of 16 columns in its first half and
// 4t+2, 4t+3 in its second (`quant.to_panels`): one `vpmovsxbw` per half loads and widens
// its weights to 16-bit pairs, and two dot products per row add them times the matching
// activation pairs. (The line used to hold each column's four inputs together, which took
// three shifts to pair up: more instructions per byte, so fewer lines in flight.) A group's int32 sums are exact (32 products of at most
// 2^15 * 2^7), and each row's float accumulator sees one multiply-add per group in every
// tile, so rows stay bit-identical whatever m is.
constexpr int kInt8PanelRows = kWideLanes ? 10 : 5;

struct Int16Rows {  // per row: k/2 dwords (pairs of int16: inputs (2i, 2i+1)), dx per group
  std::vector<int32_t> pairs;
  std::vector<float> dx;
};

// The same rounding as quant.round_activations(x, 32767), stored as the kernel reads it
Int16Rows round_rows_int16(const float* x, int64_t m, int64_t k) {
  Int16Rows r;
  const int64_t groups = k / kGroup;
  r.pairs.resize(m * k / 2);
  r.dx.resize(m * groups);
  for (int64_t i = 0; i < m * groups; ++i) {
    ILanes qa, qb;
    const float dx = round_group(x + i * kGroup, 32767.0f, qa, qb);
    store_i16(r.pairs.data() + i * (kGroup / 2), qa, qb);
    r.dx[i] = dx;
  }
  return r;
}

// rows [0, R) x the 16 columns of S panels (read side by side), over all k
template <int R, int S, bool Blocks = false>
__attribute__((noinline)) void int8_panel_tile(const IntegerTile& tile, int64_t k, const Int16Rows& xr, int64_t ldy,
                                               const float* scale, const float* bias) {
  const uint8_t *const *panel = tile.panel, *fetch_end = tile.fetch_end;
  const int64_t *col0 = tile.col0, row0 = tile.row0, ahead = tile.ahead;
  float* y = tile.y;
  const float* residual = tile.residual;
  // independent int32 sums per row, so that one row is not held up by the latency of
  // `vpdpwssd` (int32 sums are exact, so their number does not change the result); without
  // VNNI only an addition carries from one line to the next
  constexpr int kChains = kNativeDot ? std::max(1, (R == 1 ? 8 : (R == 2 ? 4 : (R <= 5 ? 2 : 1))) / S) : 1;
  constexpr int N = S * R;  // sums for row r of panel j at j * R + r
  const int64_t groups = k / kGroup;
  Lanes acc[N];
  start_sums<N, Blocks>(tile, acc);
  const int64_t g_begin = Blocks ? tile.g0 : 0, g_end = Blocks ? tile.g1 : groups;
  SpreadFetch spread(panel[0], panel[S - 1], tile.fetch, g_end - g_begin);
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* lines[S];
    for (int j = 0; j < S; ++j) lines[j] = panel[j] + g * kGroup * kPanel;
    const bool fetch = !Blocks && fetch_end && lines[0] + ahead + 512 <= fetch_end;
    const bool fetch_pair = !Blocks && S == 2 && ahead;
    if (Blocks) spread.step();
    ILanes s0[N], s1[N], s2[N], s3[N], s4[N], s5[N], s6[N], s7[N];
    ILanes* sums[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    for (int c = 0; c < kChains; ++c)
      for (int i = 0; i < N; ++i) sums[c][i] = izero();
#pragma GCC unroll 8
    for (int t = 0; t < kGroup / 4; ++t) {
      if (fetch) _mm_prefetch(reinterpret_cast<const char*>(lines[0] + ahead + 64 * t), _MM_HINT_T0);
      if (fetch_pair)
        for (int j = 0; j < S; ++j) fetch_pair_ahead(lines[j] + 64 * t, ahead, tile.far, 1);
      for (int j = 0; j < S; ++j) {
        const ILanes first = iwiden8(lines[j] + 64 * t);        // inputs 4t, 4t+1
        const ILanes second = iwiden8(lines[j] + 64 * t + 32);  // inputs 4t+2, 4t+3
        for (int r = 0; r < R; ++r) {
          const int32_t* xp = xr.pairs.data() + (row0 + r) * (k / 2) + g * (kGroup / 2) + 2 * t;
          ILanes& a = sums[(2 * t) % kChains][j * R + r];
          a = idot_i16_at(a, first, xp);
          ILanes& b = sums[(2 * t + 1) % kChains][j * R + r];
          b = idot_i16_at(b, second, xp + 1);
        }
      }
    }
    for (int i = 0; i < N; ++i) {
      ILanes total = s0[i];
      for (int c = 1; c < kChains; ++c) total = iadd(total, sums[c][i]);
      acc[i] = lfma(lfloat(total), lset1(xr.dx[(row0 + i % R) * groups + g]), acc[i]);
    }
  }
  if (put_back_sums<N, Blocks>(tile, acc, groups)) return;
  for (int j = 0; j < S; ++j) {
    const Lanes s = lload(scale + col0[j]);
    for (int r = 0; r < R; ++r) {
      Lanes v = lmul(acc[j * R + r], s);
      if (bias) v = ladd(v, lload(bias + col0[j]));
      if (residual) v = ladd(v, lload(residual + r * ldy + col0[j]));
      lstore(y + r * ldy + col0[j], v);
    }
  }
}

at::Tensor linear_int8_panels(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scale,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kChar && panels.dim() == 4 &&
              panels.size(2) == kPanel && panels.size(3) == 4 && panels.is_contiguous(),
              "int8 panels must be contiguous int8 [n/16, k/4, 16, 4]");
  const int64_t n = panels.size(0) * kPanel, k = panels.size(1) * 4, m = x.size(0);
  check_input(x, k, kGroup);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "one float32 scale per output column");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Int16Rows xr = round_rows_int16(x.data_ptr<float>(), m, k);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(panels.data_ptr<int8_t>());
  const float *sp = scale.data_ptr<float>(), *bp = optional_ptr(bias, n), *rp = optional_ptr(residual, m * n);
  float* yp = y.data_ptr<float>();
  const int64_t stride = kPanel * k;
  for_each_integer_tile<kInt8PanelRows, kPairRows>(w, n, k, m, stride, yp, rp, [&](auto rows, auto streams, auto blocks, const IntegerTile& tile) {
    int8_panel_tile<decltype(rows)::value, decltype(streams)::value, decltype(blocks)::value>(tile, k, xr, n, sp, bp);
  });
  return y;
}

// Reads int8 panels as a one-row linear_int8_panels does (the same regions, streams and
// pieces) with no arithmetic: how fast the layout alone reads, for benchmarks/product_starts.py.
// Each output holds an OR of its panel's bytes, so no read can be left out.
template <int S>
__attribute__((noinline)) void read_panel_lines(const IntegerTile& tile, int64_t k) {
  ILanes seen[S];
  for (int j = 0; j < S; ++j) seen[j] = izero();
  for (int64_t line = 0; line < k * kPanel / 64; ++line)
    for (int j = 0; j < S; ++j) {
      if (S == 2 && tile.ahead) fetch_pair_ahead(tile.panel[j] + 64 * line, tile.ahead, tile.far, 1);
      seen[j] = ior(seen[j], iload(tile.panel[j] + 64 * line));
    }
  for (int j = 0; j < S; ++j) istore(tile.y + tile.col0[j], seen[j]);
}

at::Tensor read_int8_panels(const at::Tensor& panels) {
  TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == at::kChar && panels.dim() == 4 &&
              panels.size(2) == kPanel && panels.size(3) == 4 && panels.is_contiguous(),
              "int8 panels must be contiguous int8 [n/16, k/4, 16, 4]");
  const int64_t n = panels.size(0) * kPanel, k = panels.size(1) * 4;
  at::Tensor y = at::empty({1, n}, panels.options().dtype(at::kFloat));
  const uint8_t* w = reinterpret_cast<const uint8_t*>(panels.data_ptr<int8_t>());
  for_each_integer_tile<kInt8PanelRows, 1>(w, n, k, 1, kPanel * k, y.data_ptr<float>(), nullptr,
                                        [&](auto, auto streams, auto, const IntegerTile& tile) {
    read_panel_lines<decltype(streams)::value>(tile, k);
  });
  return y;
}

// ------------------------------------------------------------------ pointwise

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous(),
              "contiguous float32 [m, 2*i] expected");
  const int64_t m = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({m, inner}, gate_up.options());
  for (int64_t r = 0; r < m; ++r) {
    const float* gate = gate_up.data_ptr<float>() + r * 2 * inner;
    const float* up = gate + inner;
    float* dst = out.data_ptr<float>() + r * inner;
    int64_t i = 0;
    for (; i + kLanes <= inner; i += kLanes) {  // g / (1 + exp(-g)) * u
      const vfloat g = vload(gate + i);
      const vfloat e = vexp(vsub(vzero(), g));
      vstore(dst + i, vmul(vdiv(g, vadd(vset1(1.0f), e)), vload(up + i)));
    }
    for (; i < inner; ++i) dst[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
  return out;
}

// RMSNorm of each row: x / sqrt(mean(x^2) + eps) * weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: float32 [m, d]");
  const int64_t m = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == d && d % kLanes == 0, "weight: float32 [d]");
  at::Tensor out = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    const float* src = x.data_ptr<float>() + r * d;
    float* dst = out.data_ptr<float>() + r * d;
    vfloat squares = vzero();
    for (int64_t i = 0; i < d; i += kLanes) squares = vfma(vload(src + i), vload(src + i), squares);
    const vfloat inv = vset1(1.0f / std::sqrt(vsum(squares) / static_cast<float>(d) + static_cast<float>(eps)));
    for (int64_t i = 0; i < d; i += kLanes) vstore(dst + i, vmul(vmul(vload(src + i), inv), vload(w + i)));
  }
  return out;
}

// ------------------------------------------------------------------ attention

template <class T> inline vfloat load_cache(const T* p);
template <> inline vfloat load_cache<float>(const float* p) { return vload(p); }
template <> inline vfloat load_cache<c10::BFloat16>(const c10::BFloat16* p) {
  return load_bf16(reinterpret_cast<const uint16_t*>(p));
}
template <> inline vfloat load_cache<c10::Half>(const c10::Half* p) {
  return load_f16(reinterpret_cast<const uint16_t*>(p));
}

// per-head RMSNorm (Qwen3's q/k norm), rounded as the reference path rounds
inline void head_norm(float* v, int64_t d, const float* weight, float eps) {
  if (!weight) return;
  double sq = 0.0;
  for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(v[i]) * v[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(sq / d) + eps);
  for (int64_t i = 0; i < d; ++i) v[i] = v[i] * inv * weight[i];
}

// rotate-half rotary embedding on the first `rot` features, same arithmetic as the reference
inline void rope(float* v, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] + (-b) * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// A chain is one (new position, query head) pair. The chains that share a key/value head
// go through the cache together: each key is scored for all of them, and each value is read
// once and weighted for each, so the cache is read once per group of chains instead of once
// per head and position (it outgrows the core's cache at long contexts). Every chain's
// arithmetic is the same sequence of operations as when it runs alone: its scores are each
// one chain of FMAs over the features and one horizontal sum, and each block of 16 features
// of its output is one chain of FMAs over the positions, in order. A task takes up to
// kMaxChains chains; registers hold the sums of up to kChainsInRegisters at a time.
constexpr int kMaxChains = 64, kChainsInRegisters = 12;

// The dot products of CT chains (from chain c0 of C) with KT = kLanes / CT consecutive keys:
// lane c * KT + u holds chain c0 + c's with key u, unscaled. Each is one chain of FMAs over the
// features, summed as vsum sums it (vsum_lanes reduces the tile's kLanes sums together).
// Meanwhile it fetches `lines` cache lines from `fetch` on, a few per block of features (a
// burst of fetches stalls once the core's line fill buffers are taken).
template <class T, int CT>
inline vfloat score_tile(const float* q, int C, int c0, const T* keys, int64_t d, const char* fetch, int64_t lines) {
  constexpr int KT = kLanes / CT;
  const int64_t per_block = (lines * kLanes + d - 1) / d;
  vfloat dot[kLanes];
  for (int x = 0; x < kLanes; ++x) dot[x] = vzero();
  for (int64_t e = 0, block = 0; e < d; e += kLanes, ++block) {
    for (int64_t line = block * per_block; line < std::min(lines, (block + 1) * per_block); ++line)
      _mm_prefetch(fetch + 64 * line, _MM_HINT_T0);
    vfloat query[CT];
    for (int c = 0; c < CT; ++c) query[c] = vload(q + (block * C + c0 + c) * kLanes);
    for (int u = 0; u < KT; ++u) {
      const vfloat key = load_cache(keys + u * d + e);
      for (int c = 0; c < CT; ++c) dot[c * KT + u] = vfma(query[c], key, dot[c * KT + u]);
    }
  }
  return vsum_lanes(dot);
}

// score_together's scores for a few chains (C), one key at a time: each key's blocks of
// features are read once, in order, and scored for all C chains. Each score is one chain of
// FMAs over the features summed by vsum, as score_tile's, so the same bits.
template <class T, int C>
void score_key_by_key(const float* q, const T* keys, int64_t d, int64_t from, int64_t to, float scale,
                      float* scores, int64_t stride, float* best) {
  for (int64_t j = from; j <= to; ++j) {
    vfloat dot[C];
    for (int c = 0; c < C; ++c) dot[c] = vzero();
    for (int64_t e = 0, block = 0; e < d; e += kLanes, ++block) {
      const vfloat key = load_cache(keys + j * d + e);
      for (int c = 0; c < C; ++c) dot[c] = vfma(vload(q + (block * C + c) * kLanes), key, dot[c]);
    }
    for (int c = 0; c < C; ++c) {
      scores[c * stride + j] = vsum(dot[c]) * scale;
      best[c] = std::max(best[c], scores[c * stride + j]);
    }
  }
}

// Chains' queries, interleaved per block of 16 features: q[(e / kLanes) * C * kLanes + c * kLanes + lane].
// scores[c * stride + j] = (q_c . key_j) * scale for j in [from, to]; best[c]: the largest so far.
// Keys go by kLanes at a time, scored in tiles of 4, 2 or 1 chains by as many keys as make
// kLanes sums, which are reduced together: a horizontal sum per key and chain took more
// operations than its FMAs.
template <class T>
void score_together(const float* q, int C, const T* keys, int64_t d, int64_t from, int64_t to, float scale,
                    float* scores, int64_t stride, float* best) {
  // Where streams are fetched in software (Intel processors; the hardware alone fell behind
  // there: benchmarks/attention.py --patch benchmarks/variants/attention_as_before.patch).
  // With a few chains (a plain step's) the scores wait on memory, and the first group of
  // chains fetches its keys attention_prefetch() bytes ahead of those it reads, as a product's
  // panels are fetched. With more they wait on arithmetic, and the tiles of each kLanes keys
  // share out the fetching of the next kLanes keys (NOTES.md, "The Xeon a fourth time").
  const int64_t ahead = attention_prefetch(), row_bytes = d * static_cast<int64_t>(sizeof(T));
  const bool few_chains = C <= 8;
  const int64_t block_lines = kLanes * row_bytes / 64, share = (block_lines + C - 1) / C;  // C tiles per kLanes keys
  vfloat high[kMaxChains];  // per group of chains: the largest scores, lane by lane as in its tiles
  for (int g = 0; g < C; ++g) high[g] = vset1(-INFINITY);
  // fn(CT, c0, g) for each group g of CT chains from c0: fours, then a two and a one
  auto each_group = [&](const auto& fn) {
    int c0 = 0, g = 0;
    for (; c0 + 4 <= C; c0 += 4) fn(std::integral_constant<int, 4>{}, c0, g++);
    if (c0 + 2 <= C) fn(std::integral_constant<int, 2>{}, c0, g++), c0 += 2;
    if (c0 < C) fn(std::integral_constant<int, 1>{}, c0, g++);
  };
  int64_t j = from;
  for (; j + kLanes <= to + 1; j += kLanes) {
    int64_t pass = 0;
    each_group([&](auto ct, int c0, int g) {
      constexpr int CT = decltype(ct)::value, KT = kLanes / CT;
      for (int u0 = 0; u0 < kLanes; u0 += KT, ++pass) {
        // few chains: the first group's own keys, ahead; more: this tile's share of the next keys
        const char* fetch = few_chains ? reinterpret_cast<const char*>(keys + (j + u0) * d) + ahead
                                       : reinterpret_cast<const char*>(keys + (j + kLanes) * d) + 64 * pass * share;
        const int64_t lines = !ahead ? 0
                              : few_chains ? (g == 0 ? KT * row_bytes / 64 : 0)
                              : j + kLanes <= to ? std::max<int64_t>(0, std::min(share, block_lines - pass * share)) : 0;
        const vfloat tile = vmul(score_tile<T, CT>(q, C, c0, keys + (j + u0) * d, d, fetch, lines), vset1(scale));
        high[g] = vmax(high[g], tile);
        for (int c = 0; c < CT; ++c) store_lanes(scores + (c0 + c) * stride + j + u0, tile, c * KT, KT);
      }
    });
  }
  each_group([&](auto ct, int c0, int g) {
    constexpr int KT = kLanes / decltype(ct)::value;
    alignas(64) float lanes[kLanes];
    vstore(lanes, high[g]);
    for (int x = 0; x < kLanes; ++x) best[c0 + x / KT] = std::max(best[c0 + x / KT], lanes[x]);
  });
  for (; j <= to; ++j)  // the last keys, one at a time
    for (int c = 0; c < C; ++c) {
      vfloat dot = vzero();
      for (int64_t e = 0, block = 0; e < d; e += kLanes, ++block)
        dot = vfma(vload(q + block * C * kLanes + c * kLanes), load_cache(keys + j * d + e), dot);
      scores[c * stride + j] = vsum(dot) * scale;
      best[c] = std::max(best[c], scores[c * stride + j]);
    }
}

// acc[c * d + e] += sum over t in [from, to] of scores[c * stride + t] * value_t[e], for C
// chains (acc holds each chain's sums over the positions before `from`). Registers hold
// C * B blocks of sums, often less than a whole value row, so the positions go by in tiles of
// about 16 KB of values, each tile's rows read once from memory and then from the cache by
// each group of blocks in turn, rather than every group streaming every row from memory.
// Where the cache is fetched in software (attention_prefetch() > 0, Intel processors), each group
// fetches its share of the next tile's rows, so that the memory is busy through all of a
// tile's arithmetic, not only the first group's (benchmarks/NOTES.md, "The Xeon a third
// time", compares this with the first group fetching the tile's rows a few ahead). Each sum
// still adds its positions in order, so tiling does not change a bit.
template <class T, int C, int B>
void weigh_blocks(const T* values, int64_t d, int64_t e, int64_t t0, int64_t t1, const float* scores, int64_t stride,
                  float* acc, const char* fetch, int64_t fetch_bytes) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  vfloat sum[C * B];
  for (int c = 0; c < C; ++c)
    for (int b = 0; b < B; ++b) sum[c * B + b] = vload(acc + c * d + e + b * kLanes);
  for (int64_t t = t0; t <= t1; ++t) {
    if (fetch) fetch_rows(fetch + (t - t0) * row_bytes, fetch_bytes, 0);
    vfloat value[B];
    for (int b = 0; b < B; ++b) value[b] = load_cache(values + t * d + e + b * kLanes);
    for (int c = 0; c < C; ++c) {
      const vfloat weight = vset1(scores[c * stride + t]);
      for (int b = 0; b < B; ++b) sum[c * B + b] = vfma(weight, value[b], sum[c * B + b]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int b = 0; b < B; ++b) vstore(acc + c * d + e + b * kLanes, sum[c * B + b]);
}

// acc += the weighted values for C chains, in tiles of about 16 KB of values; within a tile,
// the chains go in groups of up to kChainsInRegisters and each group's blocks B at a time,
// each (group, blocks) pass reading the tile's rows from the cache after the first.
template <class T>
void weigh_together(const T* values, int64_t d, int64_t from, int64_t to, const float* scores, int64_t stride,
                    int C, float* acc) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T)), tile = std::max<int64_t>(1, (16 << 10) / row_bytes);
  const int groups = (C + kChainsInRegisters - 1) / kChainsInRegisters, size = (C + groups - 1) / groups;
  with_rows<kChainsInRegisters>(size, [&](auto chains) {
    constexpr int CG = decltype(chains)::value, B = std::max(1, std::min(4, 24 / CG));  // CG * B sums in registers
    const int64_t blocks = d / (B * kLanes) + d % (B * kLanes) / kLanes;  // the blocks left over go one at a time
    const int64_t passes = groups * blocks;
    const int64_t share = (row_bytes / 64 + passes - 1) / passes * 64;  // of each row, fetched per pass
    const bool fetch = attention_prefetch() > 0;
    if (fetch) fetch_rows(values + from * d, std::min(tile, to - from + 1) * row_bytes, 0);
    for (int64_t t0 = from; t0 <= to; t0 += tile) {
      const int64_t t1 = std::min(to, t0 + tile - 1);
      const char* next = reinterpret_cast<const char*>(values + (t0 + tile) * d);
      int64_t pass = 0;
      auto fetch_from = [&] { return fetch && t1 < to && pass * share < row_bytes ? next + pass * share : nullptr; };
      auto fetch_bytes = [&] { return std::min(share, row_bytes - pass * share); };
      for (int c0 = 0; c0 < C; c0 += CG) {  // the last group may be smaller
        const float* group_scores = scores + c0 * stride;
        float* group_acc = acc + c0 * d;
        auto weigh = [&](auto count) {
          constexpr int N = decltype(count)::value;
          int64_t e = 0;
          for (; e + B * kLanes <= d; e += B * kLanes, ++pass)
            weigh_blocks<T, N, B>(values, d, e, t0, t1, group_scores, stride, group_acc, fetch_from(), fetch_bytes());
          for (; e < d; e += kLanes, ++pass)
            weigh_blocks<T, N, 1>(values, d, e, t0, t1, group_scores, stride, group_acc, fetch_from(), fetch_bytes());
        };
        if (C - c0 >= CG) weigh(chains);
        else with_rows<CG>(C - c0, weigh);
      }
    }
  });
}

// Attention for the chains of `rows` consecutive new positions (the first at `pos0`) x
// `heads` query heads sharing one key/value head. Without a window all rows attend from
// position 0, so they share positions [0, pos0]; the one to rows - 1 positions after it,
// which only later rows see, each row reads alone, after the shared ones (the order of its
// sums is unchanged). With a window, rows go one at a time.
template <class T>
void attend_chains(const float* q, int64_t rows, int64_t heads, const T* keys, const T* values, int64_t d,
                   int64_t pos0, int64_t window, float scale, float* scores, int64_t stride, float* acc,
                   float* const* out) {
  const int C = static_cast<int>(rows * heads);
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  float best[kMaxChains];
  for (int c = 0; c < C; ++c) best[c] = -INFINITY;
  // With the hardware alone fetching (AMD processors), a few chains (a plain step's) read
  // faster key by key than in tiles of keys: one position's attention took 0.58-0.79x the time
  // on the Zen 3 with AVX2 (benchmarks/NOTES.md, "The Zen 3 a fourth time") and 0.68-0.85x on
  // the Zen 4 with AVX-512 ("The Zen 4 a seventh time"). Chosen here, not inside
  // score_together, which GCC then compiled otherwise, the tiles of passes slower.
  if (C > 1 && C <= 8 && attention_prefetch() == 0)
    with_rows<8>(C, [&](auto chains) {
      score_key_by_key<T, decltype(chains)::value>(q, keys, d, first, pos0, scale, scores, stride, best);
    });
  else
    score_together<T>(q, C, keys, d, first, pos0, scale, scores, stride, best);
  std::vector<float> alone(d);
  for (int64_t r = 1; r < rows; ++r)  // later rows' own positions: each chain alone
    for (int64_t g = 0; g < heads; ++g) {
      const int64_t c = r * heads + g;
      for (int64_t e = 0; e < d; ++e) alone[e] = q[e / kLanes * C * kLanes + c * kLanes + e % kLanes];
      float* row = scores + c * stride;
      score_together<T>(alone.data(), 1, keys, d, pos0 + 1, pos0 + r, scale, row, stride, best + c);
    }
  for (int c = 0; c < C; ++c) {
    float* row = scores + c * stride;
    // exp is elementwise, so whole vectors may run past the chain's position into the padding
    const vfloat vbest = vset1(best[c]);
    for (int64_t j = first; j <= pos0 + c / heads; j += kLanes) vstore(row + j, vexp(vsub(vload(row + j), vbest)));
  }
  // each chain's total adds its positions in order, the chains side by side (one chain's
  // additions alone would each wait for the one before)
  float total[kMaxChains];
  for (int c = 0; c < C; ++c) total[c] = 0.0f;
  for (int64_t t = first; t <= pos0; ++t)
    for (int c = 0; c < C; ++c) total[c] += scores[c * stride + t];
  for (int c = 0; c < C; ++c)
    for (int64_t t = pos0 + 1; t <= pos0 + c / heads; ++t) total[c] += scores[c * stride + t];
  std::fill(acc, acc + C * d, 0.0f);
  weigh_together<T>(values, d, first, pos0, scores, stride, C, acc);
  for (int64_t r = 1; r < rows; ++r)
    for (int64_t g = 0; g < heads; ++g) {
      const int64_t c = r * heads + g;
      weigh_together<T>(values, d, pos0 + 1, pos0 + r, scores + c * stride, stride, 1, acc + c * d);
    }
  for (int c = 0; c < C; ++c) {
    const float inv = 1.0f / total[c];
    for (int64_t e = 0; e < d; ++e) out[c][e] = acc[c * d + e] * inv;
  }
}

template <class T>
void attention_impl(const float* qkv, int64_t m, int64_t hq, int64_t hkv, int64_t d, T* kc, T* vc,
                    int64_t max_len, const float* cos, const float* sin, int64_t rot, int64_t start,
                    int64_t window, const float* q_norm, const float* k_norm, float eps, float* out) {
  const int64_t row = (hq + 2 * hkv) * d;
  std::vector<float> queries(m * hq * d);
  // keys and values of the new positions go into the cache first
  for (int64_t i = 0; i < m; ++i) {
    const float* src = qkv + i * row;
    for (int64_t h = 0; h < hkv; ++h) {
      float key[1024];
      std::memcpy(key, src + (hq + h) * d, d * sizeof(float));
      head_norm(key, d, k_norm, eps);
      rope(key, cos + i * rot, sin + i * rot, rot);
      T* kdst = kc + (h * max_len + start + i) * d;
      T* vdst = vc + (h * max_len + start + i) * d;
      const float* vsrc = src + (hq + hkv + h) * d;
      for (int64_t j = 0; j < d; ++j) {
        kdst[j] = static_cast<T>(key[j]);
        vdst[j] = static_cast<T>(vsrc[j]);
      }
    }
    for (int64_t h = 0; h < hq; ++h) {
      float* qdst = queries.data() + (i * hq + h) * d;
      std::memcpy(qdst, src + h * d, d * sizeof(float));
      head_norm(qdst, d, q_norm, eps);
      rope(qdst, cos + i * rot, sin + i * rot, rot);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t group = hq / hkv;
  // Tasks of a group's heads x as many rows as keep kMaxChains chains, fewer where that
  // would leave a thread idle: rows first, then heads, down to one chain per task. The
  // more chains a task has, the fewer times the cache is read (a pass over 5 positions of
  // the 1.5B reads it once, where tasks of up to 12 chains read it three times).
  int64_t heads = std::min<int64_t>(group, kMaxChains), rows = window > 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(m, kMaxChains / heads));
  auto task_count = [&] { return hkv * ((group + heads - 1) / heads) * ((m + rows - 1) / rows); };
  const int64_t threads = at::get_num_threads();
  while (rows > 1 && task_count() < threads) rows = (rows + 1) / 2;
  if (task_count() < threads) heads = 1;
  const int64_t head_chunks = (group + heads - 1) / heads, row_chunks = (m + rows - 1) / rows;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / ((start + m) * d * heads * rows));
  parallel_range(hkv * head_chunks * row_chunks, grain, [&](int64_t begin, int64_t end) {
    const int64_t stride = start + m + kLanes;  // one chain's scores, padded for whole vectors
    std::vector<float> scores(heads * rows * stride, 0.0f), acc(heads * rows * d), q(heads * rows * d);
    std::vector<float*> out_rows(heads * rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kvh = task / (head_chunks * row_chunks), hc = task / row_chunks % head_chunks;
      const int64_t i0 = task % row_chunks * rows, h0 = kvh * group + hc * heads;
      const int64_t nr = std::min(rows, m - i0), nh = std::min(heads, group - hc * heads), C = nr * nh;
      for (int64_t r = 0; r < nr; ++r)  // the chains' queries, interleaved per block of features
        for (int64_t g = 0; g < nh; ++g) {
          const int64_t c = r * nh + g;
          const float* src = queries.data() + ((i0 + r) * hq + h0 + g) * d;
          for (int64_t e = 0; e < d; ++e) q[e / kLanes * C * kLanes + c * kLanes + e % kLanes] = src[e];
          out_rows[c] = out + ((i0 + r) * hq + h0 + g) * d;
        }
      attend_chains<T>(q.data(), nr, nh, kc + kvh * max_len * d, vc + kvh * max_len * d, d, start + i0, window,
                       scale, scores.data(), stride, acc.data(), out_rows.data());
    }
  });
}

// qkv [m, (hq + 2 hkv) d] -> attention output [m, hq d]; writes the new keys/values into
// the layer's cache [hkv, max_len, d] at positions start..start+m-1.
at::Tensor attention(const at::Tensor& qkv, at::Tensor kcache, at::Tensor vcache, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t start, int64_t hq, int64_t hkv, int64_t window,
                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                     double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(), "qkv: float32 [m, *]");
  TORCH_CHECK(kcache.dim() == 3 && kcache.is_contiguous() && vcache.is_contiguous(), "cache: [hkv, len, d]");
  const int64_t m = qkv.size(0), d = kcache.size(2), max_len = kcache.size(1);
  TORCH_CHECK(kcache.size(0) == hkv && qkv.size(1) == (hq + 2 * hkv) * d, "qkv and cache shapes disagree");
  TORCH_CHECK(d % kLanes == 0 && d <= 1024, "head_dim must be a multiple of ", kLanes);
  TORCH_CHECK(start + m <= max_len, "cache overflow");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(0) == m, "cos: float32 [m, rot]");
  const int64_t rot = cos.size(1);
  at::Tensor out = at::empty({m, hq * d}, qkv.options());
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
#define VERISPEC_ATTEND(T)                                                                              \
  attention_impl<T>(qkv.data_ptr<float>(), m, hq, hkv, d, kcache.data_ptr<T>(), vcache.data_ptr<T>(), \
                    max_len, cos.data_ptr<float>(), sin.data_ptr<float>(), rot, start, window, qn, kn, e,  \
                    out.data_ptr<float>())
  switch (kcache.scalar_type()) {
    case at::kFloat: VERISPEC_ATTEND(float); break;
    case at::kBFloat16: VERISPEC_ATTEND(c10::BFloat16); break;
    case at::kHalf: VERISPEC_ATTEND(c10::Half); break;
    default: TORCH_CHECK(false, "unsupported cache dtype");
  }
#undef VERISPEC_ATTEND
  return out;
}

// Reads every byte of a float32 tensor (sums it): the best read bandwidth these kernels see.
// With `prefetch`, each thread fetches its streams `ahead` bytes ahead (by default
// stream_prefetch(), as the panel kernels fetch a stream of several rows; a one-row
// product's two streams are fetched pair_prefetch() ahead); with `streams` = 2, each thread
// reads the two halves of its piece side by side, as the panel kernels do for one row. So
// the reference is never slower than the products measured against it.
constexpr int64_t kSumStep = 2 * kLanes;  // floats per stream and step: two vectors

// the sum of `steps` steps from each of S runs, read side by side, each fetched `ahead` bytes
// ahead (0: by the hardware alone)
template <int S>
float sum_runs(const float* const (&runs)[S], int64_t steps, int64_t ahead) {
  vfloat a[S], b[S];
  for (int s = 0; s < S; ++s) a[s] = b[s] = vzero();
  for (int64_t i = 0; i < steps; ++i)
    for (int s = 0; s < S; ++s) {
      const float* q = runs[s] + i * kSumStep;
      if (ahead)
        for (int line = 0; line < kSumStep * 4; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(q) + ahead + line, _MM_HINT_T0);
      a[s] = vadd(a[s], vload(q));
      b[s] = vadd(b[s], vload(q + kLanes));
    }
  vfloat total = vzero();
  for (int s = 0; s < S; ++s) total = vadd(total, vadd(a[s], b[s]));
  return vsum(total);
}

// the sum of steps [from, to) of p, read as S consecutive runs side by side
template <int S>
float sum_piece(const float* p, int64_t from, int64_t to, int64_t ahead) {
  const int64_t run = (to - from) / S;
  vfloat a = vzero(), b = vzero();
  for (int64_t i = from + run * S; i < to; ++i) {  // what an uneven split leaves
    a = vadd(a, vload(p + i * kSumStep));
    b = vadd(b, vload(p + i * kSumStep + kLanes));
  }
  const float* runs[S];
  for (int s = 0; s < S; ++s) runs[s] = p + (from + s * run) * kSumStep;
  return sum_runs<S>(runs, run, ahead) + vsum(vadd(a, b));
}

double stream_sum(const at::Tensor& t, bool prefetch, int64_t streams, int64_t ahead) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "a contiguous float32 tensor expected");
  TORCH_CHECK(streams == 1 || streams == 2, "1 or 2 streams per thread, not ", streams);
  TORCH_CHECK(ahead == -1 || (ahead >= 0 && ahead % 64 == 0),
              "the prefetch distance must be -1 (the default) or a multiple of 64 bytes");
  const float* p = t.data_ptr<float>();
  const int64_t steps = t.numel() / kSumStep, chunk = 1 << 16;
  ahead = prefetch ? (ahead < 0 ? stream_prefetch() : ahead) : 0;
  std::vector<double> partial((steps + chunk - 1) / chunk, 0.0);
  parallel_range(partial.size(), 1, [&](int64_t first, int64_t last) {
    const int64_t from = first * chunk, to = std::min(steps, last * chunk);
    partial[first] = streams == 2 ? sum_piece<2>(p, from, to, ahead) : sum_piece<1>(p, from, to, ahead);
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

// Where a step's streams start: a tensor read as `pieces` equal pieces one after another, each
// as one parallel call in which every thread reads its share as two streams side by side, as a
// one-row product reads its panels (without stealing). In place, piece i is the tensor's i-th
// slice, so each piece starts every stream afresh, as each product of a step does. With
// `continuous`, the tensor is one arena per thread and stream, and each stream's part of piece
// i follows its part of piece i - 1: the same reads, the same calls, unbroken streams.
double stream_pieces(const at::Tensor& t, int64_t pieces, bool continuous) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "a contiguous float32 tensor expected");
  const int64_t threads = WorkPool::instance().threads(), streams = 2 * threads;
  const int64_t part = t.numel() / kSumStep / std::max<int64_t>(1, pieces) / streams;  // steps per stream and piece
  TORCH_CHECK(pieces >= 1 && part >= 1, "too many pieces for a tensor of ", t.numel(), " floats");
  const float* p = t.data_ptr<float>();
  auto start = [&](int64_t piece, int64_t stream) {  // where a stream's part of a piece begins
    return p + (continuous ? stream * pieces + piece : piece * streams + stream) * part * kSumStep;
  };
  std::vector<double> partial(threads, 0.0);
  for (int64_t i = 0; i < pieces; ++i)
    WorkPool::instance().run(threads, [&](int64_t r) {
      const float* runs[2] = {start(i, 2 * r), start(i, 2 * r + 1)};
      partial[r] += sum_runs<2>(runs, part, 0);
    });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}


// ------------------------------------------------------------------ a decoder stack in one call
//
// The lean forward made ~8 Python calls per layer, each paying Python's and pybind11's call
// overhead of a few microseconds; over a 1.5B model's 28 layers that is a millisecond per
// step, 5-8% of a 4-bit step on a fast memory system and more of a small draft's. A
// `Product` binds one projection's kernel to its tensors; a `DecoderStack` runs every layer's
// norm, products, attention and SwiGLU in C++ with the same kernels in the same order, so
// its results are bit-identical to the Python loop's.

using ProductFn = at::Tensor (*)(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                 const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual);

ProductFn product_kernel(const std::string& name, size_t tensors) {
  struct Entry { const char* name; size_t tensors; ProductFn fn; };
  static const Entry entries[] = {
      {"linear_float", 1, [](const at::Tensor& x, const std::vector<at::Tensor>& w, const c10::optional<at::Tensor>& b,
                             const c10::optional<at::Tensor>& r) { return linear_float(x, w[0], b, r); }},
      {"linear_int8", 2, [](const at::Tensor& x, const std::vector<at::Tensor>& w, const c10::optional<at::Tensor>& b,
                            const c10::optional<at::Tensor>& r) { return linear_int8(x, w[0], w[1], b, r); }},
      {"linear_int4", 2, [](const at::Tensor& x, const std::vector<at::Tensor>& w, const c10::optional<at::Tensor>& b,
                            const c10::optional<at::Tensor>& r) { return linear_int4(x, w[0], w[1], b, r); }},
      {"linear_float_panels", 1, [](const at::Tensor& x, const std::vector<at::Tensor>& w,
                                    const c10::optional<at::Tensor>& b, const c10::optional<at::Tensor>& r) {
         return linear_float_panels(x, w[0], b, r); }},
      {"linear_int8_panels", 2, [](const at::Tensor& x, const std::vector<at::Tensor>& w,
                                   const c10::optional<at::Tensor>& b, const c10::optional<at::Tensor>& r) {
         return linear_int8_panels(x, w[0], w[1], b, r); }},
      {"linear_int4_panels", 1, [](const at::Tensor& x, const std::vector<at::Tensor>& w,
                                   const c10::optional<at::Tensor>& b, const c10::optional<at::Tensor>& r) {
         return linear_int4_panels(x, w[0], b, r); }},
  };
  for (const Entry& e : entries)
    if (name == e.name) {
      TORCH_CHECK(tensors == e.tensors, name, " takes ", e.tensors, " weight tensors, not ", tensors);
      return e.fn;
    }
  TORCH_CHECK(false, "no product kernel named ", name);
}

// One projection: a kernel bound to its weight tensors and bias. Callable as product(x, residual).
struct Product {
  Product(const std::string& kernel, std::vector<at::Tensor> weights, c10::optional<at::Tensor> bias)
      : fn(product_kernel(kernel, weights.size())), weights(std::move(weights)), bias(std::move(bias)),
        panels(kernel.size() > 7 && kernel.compare(kernel.size() - 7, 7, "_panels") == 0) {}
  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& residual = c10::nullopt) const {
    return fn(x, weights, bias, residual);
  }
  // has the helpers read the start of their regions of this product's panels (read_ahead)
  void read_ahead() const {
    if (!panels || !helper_prefetch()) return;
    const at::Tensor& p = weights[0];  // [panels, ...]
    const int64_t count = p.size(0), stride = p.nbytes() / count;
    WorkPool::instance().read_ahead(RegionStart{static_cast<const uint8_t*>(p.data_ptr()), count, stride,
                                                region_count(count, stride), helper_prefetch()});
  }
  ProductFn fn;
  std::vector<at::Tensor> weights;
  c10::optional<at::Tensor> bias;
  bool panels;  // a panel kernel: weights[0] is [panels, ...], read by region
};

struct DecoderLayer {
  at::Tensor norm1, norm2;
  double eps1, eps2;
  Product qkv, out, gate_up, down;
  int64_t index, heads, kv_heads, window;
  c10::optional<at::Tensor> q_norm, k_norm;
  double qk_eps;
};

// x [m, hidden] through every layer: the hidden states after the last (before the final norm).
// Before each norm and SwiGLU the helpers start reading the product that follows it.
// k and v are the cache's [layers, 1, kv_heads, length, head_dim] tensors; positions start at `start`.
struct DecoderStack {
  std::vector<DecoderLayer> layers;
  at::Tensor forward(at::Tensor x, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, int64_t start) const {
    for (const DecoderLayer& layer : layers) {
      layer.qkv.read_ahead();
      at::Tensor h = rms_norm(x, layer.norm1, layer.eps1);
      const at::Tensor qkv = layer.qkv(h);
      const at::Tensor attended = attention(qkv, k.select(0, layer.index).select(0, 0),
                                            v.select(0, layer.index).select(0, 0), cos, sin, start, layer.heads,
                                            layer.kv_heads, layer.window, layer.q_norm, layer.k_norm, layer.qk_eps);
      x = layer.out(attended, x);
      layer.gate_up.read_ahead();
      h = rms_norm(x, layer.norm2, layer.eps2);
      const at::Tensor gate_up = layer.gate_up(h);
      layer.down.read_ahead();
      x = layer.down(silu_mul(gate_up), x);
    }
    return x;
  }
};

}  // namespace

// ------------------------------------------------------------------ sampling

// The sampler's rows, warped in place: float32 [..., n] on the CPU, contiguous
void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous() && x.device().is_cpu(),
              "contiguous float32 CPU rows expected");
}

// row = 0 but at the first `count` ids of `kept` (value, id), each its value over their total
void keep_only(float* row, int64_t n, const std::vector<std::pair<float, int32_t>>& kept, size_t count, double total) {
  std::fill(row, row + n, 0.0f);
  const float sum = static_cast<float>(total);
  for (size_t i = 0; i < count; ++i) row[kept[i].second] = kept[i].first / sum;
}

// softmax(x * scale) of each row of float32 [rows, n], in place: the sampler's warp at
// temperature 1/scale in three reads of the row (its maximum; exp and sum; the division)
// where NumPy's and torch's operations take six. Ids more than 87 below the maximum (after
// the scale) get 0, where exp would give less than 2e-38: masked (-inf) logits stay impossible.
void softmax_(const at::Tensor& x, double scale) {
  check_rows(x);
  TORCH_CHECK(scale > 0, "scale must be positive");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const float s = static_cast<float>(scale);
  const vfloat vs = vset1(s), floor = vset1(-87.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data_ptr<float>() + r * n;
    int64_t i = 0;
    vfloat best = vset1(-INFINITY);
    for (; i + kLanes <= n; i += kLanes) best = vmax(best, vload(row + i));
    float top = vmaxall(best);
    for (; i < n; ++i) top = std::max(top, row[i]);
    const float shift = top * s;  // max(x * s) for s > 0: rounding keeps the order
    vfloat sums[2] = {vzero(), vzero()};
    float tail = 0.0f;
    for (i = 0; i + kLanes <= n; i += kLanes) {
      const vfloat z = vsub(vmul(vload(row + i), vs), vset1(shift));
      const vfloat e = vkeep_from(vexp(z), z, floor);
      vstore(row + i, e);
      sums[(i / kLanes) & 1] = vadd(sums[(i / kLanes) & 1], e);
    }
    for (; i < n; ++i) {
      const float z = row[i] * s - shift;
      row[i] = z >= -87.0f ? std::exp(z) : 0.0f;
      tail += row[i];
    }
    const float inverse = 1.0f / (vsum(vadd(sums[0], sums[1])) + tail);
    const vfloat vinverse = vset1(inverse);
    for (i = 0; i + kLanes <= n; i += kLanes) vstore(row + i, vmul(vload(row + i), vinverse));
    for (; i < n; ++i) row[i] *= inverse;
  }
}

// The ids i of `row` where row[i] * scale >= floor, in increasing order.
void ids_at_least(const float* row, int64_t n, float floor, std::vector<int32_t>& ids, float scale = 1.0f) {
  ids.clear();
  const vfloat vfloor = vset1(floor), vscale = vset1(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)  // most blocks hold none: one comparison each
    for (uint32_t mask = vmask_at_least(vmul(vload(row + i), vscale), vfloor); mask; mask &= mask - 1)
      ids.push_back(static_cast<int32_t>(i + __builtin_ctz(mask)));
  for (; i < n; ++i)
    if (row[i] * scale >= floor) ids.push_back(static_cast<int32_t>(i));
}

// softmax(x * scale) over the k largest of each row of float32 [rows, n], in place; every
// other id 0. Ids tied with the k-th largest stay (as the NumPy path's masking keeps them).
// The k-th largest comes from a heap of the k largest so far, which most blocks of the row
// pass by with one comparison against its least, where NumPy's partition moves the whole row.
void top_k_(const at::Tensor& x, double scale, int64_t k) {
  check_rows(x);
  TORCH_CHECK(scale > 0, "scale must be positive");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, ", n, "], not ", k);
  const float s = static_cast<float>(scale);
  std::vector<float> heap;  // the k largest scaled values so far, the least on top
  std::vector<int32_t> ids;
  std::vector<std::pair<float, int32_t>> kept;  // (exp, id)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data_ptr<float>() + r * n;
    heap.clear();
    const auto offer = [&](float z) {
      if (static_cast<int64_t>(heap.size()) < k) {
        heap.push_back(z);
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      } else if (z > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = z;
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    };
    const vfloat vs = vset1(s);
    int64_t i = 0;
    for (; i < std::min(n, k); ++i) offer(row[i] * s);
    for (; i + kLanes <= n; i += kLanes)
      for (uint32_t mask = vmask_at_least(vmul(vload(row + i), vs), vset1(std::nextafter(heap.front(), INFINITY)));
           mask; mask &= mask - 1)
        offer(row[i + __builtin_ctz(mask)] * s);
    for (; i < n; ++i) offer(row[i] * s);
    const float top = *std::max_element(heap.begin(), heap.end());
    ids_at_least(row, n, heap.front(), ids, s);
    kept.resize(ids.size());
    double total = 0.0;
    for (size_t j = 0; j < ids.size(); ++j) {
      kept[j] = {std::exp(row[ids[j]] * s - top), ids[j]};
      total += kept[j].first;
    }
    keep_only(row, n, kept, kept.size(), total);
  }
}

// Top-p on each row of float32 probabilities [rows, n], in place: the most probable ids
// (ties: the lower id first, as a stable sort), each kept while the mass before it is below
// top_p (so the first always stays), renormalised; every other id gets 0. Only the ids of at
// least a floor's probability are sorted (`floors`, falling, the last 0), the floor lowered
// while they hold less than top_p: no id below them can be kept then. The same as
// sampling._keep_nucleus, whose NumPy operations read the row several times more and write
// every id twice; the masses are summed in double in the same order, so the same ids are
// kept, and the kept sum too is a double here (NumPy's float32 sum may differ in the last bit).
void nucleus_(const at::Tensor& x, double top_p, const std::vector<double>& floors) {
  check_rows(x);
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], not ", top_p);
  TORCH_CHECK(!floors.empty() && floors.back() == 0.0, "the last floor must be 0, so that every id can be reached");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  std::vector<int32_t> ids;
  std::vector<std::pair<float, int32_t>> ranked;  // (probability, id), sorted beside each other
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data_ptr<float>() + r * n;
    for (const double floor : floors) {
      ids_at_least(row, n, static_cast<float>(floor), ids);  // at floor 0 every id: probabilities are never below it
      ranked.resize(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) ranked[i] = {row[ids[i]], ids[i]};
      std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      double mass = 0.0;
      for (const auto& each : ranked) mass += each.first;
      if (!ranked.empty() && mass >= top_p) break;
    }
    size_t kept = 0;  // the ids kept, moved to the front of `ranked`
    double mass = 0.0, total = 0.0;
    for (const auto& each : ranked) {
      mass += each.first;
      if (mass - each.first < top_p) {  // the mass before it, as the NumPy path takes it
        ranked[kept++] = each;
        total += each.first;
      }
    }
    keep_only(row, n, ranked, kept, total);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_float", &linear_float, "x @ w.T (+ bias) (+ residual) for float32/bfloat16/float16 w");
  m.def("linear_int8", &linear_int8, "x @ (w * scale[:, None]).T (+ bias) (+ residual)");
  m.def("linear_int4", &linear_int4, "x @ dequant(q, scales).T (+ bias) (+ residual)");
  m.def("dequantize_int4", &dequantize_int4, "the float32 weights of the int4 format");
  m.def("linear_int4_panels", &linear_int4_panels,
        "x @ dequant(panels).T (+ bias) (+ residual), activations rounded to int8 per group of 32");
  m.def("int4_to_panels", &int4_to_panels, "(nibbles, scales) -> the panel layout of linear_int4_panels");
  m.def("dequantize_int4_panels", &dequantize_int4_panels, "the float32 weights of the panel layout");
  m.attr("int4_panel") = kPanel;
  m.def("linear_float_panels", &linear_float_panels,
        "x @ W.T (+ bias) (+ residual) for float W in the panel layout [n/16, k/L, 16, L]");
  m.def("read_int8_panels", &read_int8_panels,
        "int8 panels read as a one-row product reads them, without its arithmetic (a benchmark's yardstick)");
  m.def("linear_int8_panels", &linear_int8_panels,
        "x @ (W * scale[:, None]).T (+ bias) (+ residual), int8 W in panels [n/16, k/4, 16, 4], "
        "activations in 16-bit fixed point per group of 32");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for [gate | up] rows");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("softmax_", &softmax_, "softmax(x * scale) of each row, in place", py::arg("x"), py::arg("scale"));
  m.def("top_k_", &top_k_, "softmax(x * scale) over the k largest of each row, in place", py::arg("x"),
        py::arg("scale"), py::arg("k"));
  m.def("nucleus_", &nucleus_, "top-p of each row of probabilities, in place", py::arg("x"), py::arg("top_p"),
        py::arg("floors"));
  m.def("attention", &attention, "rotary + cache write + causal attention for a few positions");
  py::class_<Product>(m, "Product", "one projection's kernel bound to its weights: product(x, residual=None)")
      .def(py::init<const std::string&, std::vector<at::Tensor>, c10::optional<at::Tensor>>(),
           py::arg("kernel"), py::arg("weights"), py::arg("bias") = py::none())
      .def("__call__", &Product::operator(), py::arg("x"), py::arg("residual") = py::none());
  py::class_<DecoderLayer>(m, "DecoderLayer", "one pre-norm decoder layer's tensors and products")
      .def(py::init([](at::Tensor norm1, double eps1, Product qkv, Product out, at::Tensor norm2, double eps2,
                       Product gate_up, Product down, int64_t index, int64_t heads, int64_t kv_heads, int64_t window,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double qk_eps) {
             return DecoderLayer{norm1, norm2, eps1, eps2, qkv, out, gate_up, down, index, heads, kv_heads, window,
                                 q_norm, k_norm, qk_eps};
           }),
           py::arg("norm1"), py::arg("eps1"), py::arg("qkv"), py::arg("out"), py::arg("norm2"), py::arg("eps2"),
           py::arg("gate_up"), py::arg("down"), py::arg("index"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("window"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qk_eps"));
  py::class_<DecoderStack>(m, "DecoderStack", "decoder layers run in one call")
      .def(py::init([](std::vector<DecoderLayer> layers) { return DecoderStack{std::move(layers)}; }))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("k"), py::arg("v"), py::arg("cos"),
           py::arg("sin"), py::arg("start"));
  m.def("set_stream_prefetch", &set_stream_prefetch,
        "how many bytes ahead the panel kernels fetch each thread's stream (0: leave it to the hardware)");
  m.def("stream_prefetch", &stream_prefetch, "the panel kernels' prefetch distance in bytes");
  m.def("set_pass_stream_prefetch", &set_pass_stream_prefetch, "how many bytes ahead products of several rows "
        "that read one stream per thread fetch it (0: leave it to the hardware)");
  m.def("pass_stream_prefetch", &pass_stream_prefetch, "how many bytes ahead products of several rows that read "
        "one stream per thread fetch it");
  m.def("set_helper_prefetch", &set_helper_prefetch, "how many bytes of the start of each of its two streams "
        "a helper reads for the next product of a decoder stack while the calling thread does a layer's serial work "
        "(0: none)");
  m.def("helper_prefetch", &helper_prefetch, "how many bytes of each of its streams a helper reads ahead of a product");
  m.def("set_pair_l2_prefetch", &set_pair_l2_prefetch, "how many bytes ahead each of the two streams per thread "
        "of a product that reads pairs is also fetched into L2, where it is fetched in software (0, or no further "
        "than into L1: not)");
  m.def("pair_l2_prefetch", &pair_l2_prefetch, "how many bytes ahead the two streams per thread of a product "
        "that reads pairs are fetched into L2");
  m.def("set_pass_pair_l2_prefetch", &set_pass_pair_l2_prefetch, "how many bytes ahead integer products of "
        "pass_pair_rows rows or more that read pairs in one tile also fetch each stream into L2 (0, or no further "
        "than into L1: not)");
  m.def("pass_pair_l2_prefetch", &pass_pair_l2_prefetch, "how many bytes ahead integer passes that read pairs "
        "in one tile fetch each stream into L2");
  m.def("set_pair_prefetch", &set_pair_prefetch,
        "how many bytes ahead each of a product's two streams per thread is fetched in software (0: by the hardware alone)");
  m.def("pair_prefetch", &pair_prefetch, "how many bytes ahead a product's two streams per thread are fetched");
  m.def("set_attention_prefetch", &set_attention_prefetch,
        "how many bytes ahead attention fetches its cached keys in software (0: by the hardware alone)");
  m.def("attention_prefetch", &attention_prefetch, "how many bytes ahead attention fetches its cached keys");
  m.def("set_pass_pair_prefetch", &set_pass_pair_prefetch, "how many bytes ahead products of pass_pair_rows rows or "
        "more that read two streams per thread fetch each in software (0: by the hardware alone)");
  m.def("pass_pair_prefetch", &pass_pair_prefetch,
        "how many bytes ahead products of pass_pair_rows rows or more fetch their pairs");
  m.def("pass_pair_rows", &pass_pair_rows_of, "from how many rows a product that reads two streams per thread "
        "fetches them pass_pair_prefetch() ahead, in weights 'int4', 'int8', 'float32', 'bfloat16' or 'float16'",
        py::arg("weights"));
  m.def("set_pair_rows", &set_pair_rows, "products of up to this many rows read two streams per thread "
        "(where the format has such tiles), for 'integer' or 'float' panels or 'all'",
        py::arg("rows"), py::arg("kind") = "all");
  m.def("pair_rows", &pair_rows_of, "up to how many rows a product of 'integer' or 'float' panels reads two "
        "streams per thread", py::arg("kind"));
  m.def("set_panel_streams", &set_panel_streams, "streams each thread reads side by side in few-row products (1 or 2)");
  m.def("panel_streams", &panel_streams, "streams each thread reads side by side in few-row products");
  m.def("stream_sum", &stream_sum, "sum of a float32 tensor, read once (with prefetch: `ahead` bytes ahead, "
        "by default stream_prefetch())", py::arg("t"), py::arg("prefetch") = false, py::arg("streams") = 1,
        py::arg("ahead") = -1);
  m.def("stream_pieces", &stream_pieces,
        "sum of a float32 tensor read as pieces one after another, two streams per thread, each "
        "piece's streams started afresh or (continuous) following on from the piece before",
        py::arg("t"), py::arg("pieces"), py::arg("continuous") = false);
  m.attr("lanes") = kLanes;
}
