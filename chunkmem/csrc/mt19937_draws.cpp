// The numbers torch.randint(0, 2**16, ..., dtype=torch.int32) draws from torch's CPU generator, drawn or skipped
// without torch's per-element loop (chunkmem/optim/rounding_draws.py).
//
// torch's CPU generator is a Mersenne twister (MT19937) whose state torch exports as 5056 bytes
// (Generator.get_state()): an int64 seed, the int `left` and `seeded`, the uint64 `next`, then the 624 words of the
// state, each widened to uint64, then the normal distribution's cache (untouched here). One call of the engine
// decrements `left`, regenerates the 624 words when it reaches 0 (then left = 624, next = 0), and returns word
// `next++` tempered. torch.randint(0, 65536) takes one such 32-bit number per element, in order, and keeps it
// modulo 65536. Python checks these functions against torch.randint when it loads them; any difference and it
// draws with torch instead.
#include <cstdint>
#include <cstring>

namespace {

constexpr int N = 624;
constexpr int M = 397;
constexpr uint32_t MATRIX_A = 0x9908b0dfu;
constexpr size_t LEFT_OFFSET = 8, NEXT_OFFSET = 16, WORDS_OFFSET = 24;

struct Engine {
    uint32_t words[N];
    int32_t left;
    uint64_t next;

    explicit Engine(const uint8_t* state) {
        std::memcpy(&left, state + LEFT_OFFSET, sizeof(left));
        std::memcpy(&next, state + NEXT_OFFSET, sizeof(next));
        for (int i = 0; i < N; ++i) {
            uint64_t word;
            std::memcpy(&word, state + WORDS_OFFSET + 8 * i, sizeof(word));
            words[i] = static_cast<uint32_t>(word);
        }
    }

    void store(uint8_t* state) const {
        std::memcpy(state + LEFT_OFFSET, &left, sizeof(left));
        std::memcpy(state + NEXT_OFFSET, &next, sizeof(next));
        for (int i = 0; i < N; ++i) {
            uint64_t word = words[i];
            std::memcpy(state + WORDS_OFFSET + 8 * i, &word, sizeof(word));
        }
    }

    static inline uint32_t twist(uint32_t u, uint32_t v) {
        uint32_t mixed = (u & 0x80000000u) | (v & 0x7fffffffu);
        return (mixed >> 1) ^ ((v & 1u) ? MATRIX_A : 0u);
    }

    // Each loop reads only words it has not written yet (i + 1, i + M) or wrote at least N - M = 227 steps
    // before (i + M - N), so the compiler may run it several words at a time.
    void regenerate() {
        uint32_t* __restrict w = words;
        for (int i = 0; i < N - M; ++i) w[i] = w[i + M] ^ twist(w[i], w[i + 1]);
        for (int i = N - M; i < N - 1; ++i) w[i] = w[i + M - N] ^ twist(w[i], w[i + 1]);
        w[N - 1] = w[M - 1] ^ twist(w[N - 1], w[0]);
        left = N;
        next = 0;
    }

    static inline uint32_t temper(uint32_t y) {
        y ^= (y >> 11);
        y ^= (y << 7) & 0x9d2c5680u;
        y ^= (y << 15) & 0xefc60000u;
        y ^= (y >> 18);
        return y;
    }

    // n calls' numbers modulo 2^16 into out: runs of the words ready, without a branch per number.
    void draw_low16(int32_t* __restrict out, int64_t n) {
        while (n > 0) {
            if (left == 1) {  // this call regenerates, then takes word 0 (left stays N)
                regenerate();
                *out++ = static_cast<int32_t>(temper(words[next++]) & 0xffffu);
                --n;
                continue;
            }
            int64_t take = n < left - 1 ? n : left - 1;
            const uint32_t* __restrict w = words + next;
            for (int64_t i = 0; i < take; ++i) out[i] = static_cast<int32_t>(temper(w[i]) & 0xffffu);
            out += take;
            next += static_cast<uint64_t>(take);
            left -= static_cast<int32_t>(take);
            n -= take;
        }
    }

    // What n calls change, without tempering the numbers nobody reads.
    void skip(int64_t n) {
        int64_t ready = left - 1;  // calls before the next regeneration
        if (n <= ready) {
            left -= static_cast<int32_t>(n);
            next += static_cast<uint64_t>(n);
            return;
        }
        n -= ready;
        int64_t regenerations = (n + N - 1) / N;
        for (int64_t r = 0; r < regenerations; ++r) regenerate();
        int64_t taken = n - N * (regenerations - 1);  // calls since the last regeneration, the one that made it too
        left = static_cast<int32_t>(N + 1 - taken);
        next = static_cast<uint64_t>(taken);
    }
};

}  // namespace

extern "C" {

int chunkmem_mt19937_abi() { return 1; }

// The next n numbers of torch.randint(0, 65536, dtype=torch.int32) into out; the state moves past them.
void chunkmem_mt19937_draw_low16(uint8_t* state, int32_t* out, int64_t n) {
    Engine engine(state);
    engine.draw_low16(out, n);
    engine.store(state);
}

// The state after n more 32-bit numbers.
void chunkmem_mt19937_skip(uint8_t* state, int64_t n) {
    Engine engine(state);
    engine.skip(n);
    engine.store(state);
}

}  // extern "C"
